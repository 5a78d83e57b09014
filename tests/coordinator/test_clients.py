"""The typed role clients against real in-process gRPC servers: failover on a dead instance, retry elsewhere when
full, a request's own error raised as the role sent it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from coordinator.clients import EncodeClient
from coordinator.context import RequestContext
from coordinator.metrics import CoordinatorMetrics
from coordinator.routing.pool import InstancePool
from services.protocol.errors import InvalidRequest, Overloaded
from services.rpc.handlers import rpc_method
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc
from services.server import free_port


class Encoder(rpc.EncodeServiceServicer):
    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.calls = 0

    @rpc_method
    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext):
        self.calls += 1
        if self.behaviour == "full":
            raise Overloaded("encode is full", code="encode_queue_full")
        if self.behaviour == "bad":
            raise InvalidRequest("bad item", code="invalid_item")
        return pb.EncodeResponse(request_id=request.request_id, items=[pb.EncodedItem(mm_hash="h")])


async def _serve(servicer: Encoder) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    rpc.add_EncodeServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _ctx() -> RequestContext:
    return RequestContext(request_id="r1", deadline=time.monotonic() + 10)


async def _call(behaviours: list[str], dead_first: bool = False):
    servicers = [Encoder(b) for b in behaviours]
    served = [await _serve(s) for s in servicers]
    addresses = [address for _, address in served]
    if dead_first:
        addresses.insert(0, f"127.0.0.1:{free_port()}")
    pool = InstancePool("encode", addresses, rpc.EncodeServiceStub, policy="round_robin",
                        metrics=CoordinatorMetrics(CollectorRegistry()))
    try:
        reply, instance = await EncodeClient(pool).encode(_ctx(), pb.MultiModalItem(mm_hash="h"))
        return reply, instance, pool, servicers, None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return None, None, pool, servicers, exc
    finally:
        await pool.close()
        for server, _ in served:
            await server.stop(None)


def test_a_dead_instance_is_marked_down_and_the_call_fails_over():
    reply, instance, pool, servicers, err = asyncio.run(_call(["ok"], dead_first=True))
    assert err is None and reply.mm_hash == "h"
    dead = pool.instances[0]
    assert not dead.healthy and instance is pool.instances[1]


def test_a_full_instance_is_skipped_without_being_marked_down():
    reply, instance, pool, servicers, err = asyncio.run(_call(["full", "ok"]))
    assert err is None and instance is pool.instances[1]
    assert all(i.healthy for i in pool.instances)
    assert [s.calls for s in servicers] == [1, 1]


def test_when_every_instance_is_full_the_answer_is_429_with_retry_after():
    _, _, _, servicers, err = asyncio.run(_call(["full", "full"]))
    assert isinstance(err, Overloaded) and err.status == 429 and err.retry_after_s == 1.0
    assert [s.calls for s in servicers] == [1, 1]


def test_a_request_error_is_not_retried():
    _, _, pool, servicers, err = asyncio.run(_call(["bad", "ok"]))
    assert isinstance(err, InvalidRequest) and err.code == "invalid_item"
    assert sum(s.calls for s in servicers) == 1 and all(i.healthy for i in pool.instances)


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_grpc_limit_without_an_epd_code_is_not_a_429(code):
    from coordinator.clients import error_from_rpc

    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="message too large")
    assert error_from_rpc(exc).status == 500
