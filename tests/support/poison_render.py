"""A FAKE render instance for the retry-budget test (tests/e2e/test_retry_budget.py).

It forwards every call to a real render instance, except that a chat whose
body carries the marker POISON makes this process exit at once.  It stands in
for a crash bug (a request that kills whichever instance serves it), which
cannot be produced for real without shipping a real bug.  It serves the gRPC
health protocol, so the coordinator admits it like any render instance.

    python -m tests.support.poison_render PORT REAL_RENDER_GRPC_ADDRESS
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.rpc.v1 import epd_pb2_grpc as rpc

MARKER = b"POISON"


class ForwardingRender(rpc.RenderServiceServicer):
    def __init__(self, stub: Any) -> None:
        self.stub = stub

    async def _forward(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=context.time_remaining(),
                                                    metadata=context.invocation_metadata())
        except grpc.aio.AioRpcError as exc:  # the real render's error, as it sent it (epd code included)
            await context.abort(exc.code(), exc.details() or "", trailing_metadata=exc.trailing_metadata())

    async def RenderChat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if MARKER in request.chat_request_json:
            os._exit(3)  # the crash this fake exists for
        return await self._forward("RenderChat", request, context)

    async def RenderCompletion(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("RenderCompletion", request, context)

    async def RenderContentParts(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("RenderContentParts", request, context)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._forward("Detokenize", request, context)


async def main(port: int, target: str) -> None:
    channel = grpc.aio.insecure_channel(target)
    server = grpc.aio.server()
    rpc.add_RenderServiceServicer_to_server(ForwardingRender(rpc.RenderServiceStub(channel)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print("serving", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
