"""Decode: kv_transfer_params + first token -> a stream of token deltas.

The stream is a gRPC server stream; cancelling the consumer (client went
away) cancels the call, and the decode role frees the slot.  A decode
instance that dies mid-stream surfaces as an Unavailable error in-stream: the
tokens already sent cannot be replayed elsewhere, so no silent retry.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from services.protocol.errors import DeadlineExceeded, Unavailable
from services.rpc.v1 import epd_pb2 as pb

from ..clients import call_metadata, error_from_rpc, is_transport_failure
from ..cluster import Cluster
from ..context import RequestContext


class DecodeStep:
    name = "decode"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def stream(self, ctx: RequestContext) -> AsyncIterator[pb.DecodeChunk]:
        assert ctx.prefill is not None and ctx.rendered is not None
        request = pb.DecodeRequest(
            request_id=ctx.request_id, kv_transfer_params_json=ctx.prefill.kv_transfer_params_json,
            sampling=ctx.extra["sampling"], prompt_tokens=ctx.prefill.prompt_tokens,
            first_token_id=ctx.prefill.first_token_id)
        instance = self.cluster.decode.pick()
        ctx.instances["decode"] = instance.address
        started = time.perf_counter()
        call = instance.stub.Decode(request, timeout=ctx.time_left(), metadata=call_metadata(ctx))
        try:
            with self.cluster.decode.track(instance):
                async for chunk in call:
                    ctx.timings.setdefault("decode_first_chunk", time.perf_counter() - started)
                    yield chunk
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"request {ctx.request_id} exceeded its deadline in decode") from None
            if is_transport_failure(exc):
                self.cluster.decode.mark_down(instance, f"Decode: {exc.code().name}")
                raise Unavailable(f"decode instance failed mid-stream ({exc.code().name})",
                                  code="decode_failed") from None
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()
            ctx.timings["decode"] = time.perf_counter() - started
