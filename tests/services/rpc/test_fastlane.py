"""The fast lane (services/rpc/fastlane*.py) against gRPC, both real: one servicer served on a gRPC port and on
its Unix socket, called through the coordinator's stub.  The servicer is a test one (DecodeService's shapes: a
server stream and a unary call, behind the real rpc_stream / rpc_method wrappers); it notes the peer of each
call, so every test knows which transport carried it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.protocol.errors import ERROR_CODE_METADATA_KEY, InvalidRequest
from services.rpc import fastlane
from services.rpc.fastlane_client import FastLaneStub, fast_lane_port, with_fast_lane
from services.rpc.fastlane_server import FastLaneServer
from services.rpc.handlers import rpc_method, rpc_stream
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc
from services.server import free_port

METHOD = f"{pb.DESCRIPTOR.services_by_name['DecodeService'].full_name}/Abort"


class Servicer(rpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.peers: list[str] = []
        self.cancelled: list[str] = []

    @rpc_stream
    async def Decode(self, request: pb.DecodeRequest, context):
        self.peers.append(context.peer())
        try:
            for i in range(request.prompt_tokens):
                yield pb.DecodeChunk(token_ids=[request.first_token_id + i], text=f"t{i}")
                await asyncio.sleep(0.05 if request.request_id == "slow" else 0)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    @rpc_method
    async def Abort(self, request: pb.AbortRequest, context):
        self.peers.append(context.peer())
        if "bad" in request.request_ids:
            raise InvalidRequest("request id 'bad' is refused", code="bad_request_id")
        if "sleep" in request.request_ids:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append("sleep")
                raise
        return pb.AbortResponse(aborted=len(request.request_ids))


class Both:
    """The servicer on a gRPC port and on that port's fast lane; a plain gRPC stub and the fast-lane one."""

    def __init__(self, servicer: Servicer) -> None:
        self.servicer = servicer

    async def __aenter__(self) -> Both:
        self.server = grpc.aio.server()
        rpc.add_DecodeServiceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await self.server.start()
        self.fast = FastLaneServer.from_registration(
            lambda s: rpc.add_DecodeServiceServicer_to_server(self.servicer, s), self.port)
        await self.fast.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.grpc_stub = rpc.DecodeServiceStub(self.channel)
        self.stub = with_fast_lane(self.grpc_stub, f"127.0.0.1:{self.port}", secure=False)
        assert isinstance(self.stub, FastLaneStub)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stub.close()
        await self.fast.close()
        await self.channel.close()
        await self.server.stop(None)


@pytest.fixture(autouse=True)
def socket_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(fastlane.ENV_DIR, str(tmp_path))


async def _stream(stub, request: pb.DecodeRequest, timeout: float = 10) -> list[pb.DecodeChunk]:
    call = stub.Decode(request, timeout=timeout, metadata=[("x-request-id", request.request_id)])
    out = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        out.append(chunk)
    return out


def test_same_answers_as_grpc_and_the_fast_lane_really_carries_them():
    async def main() -> None:
        async with Both(Servicer()) as both:
            request = pb.DecodeRequest(request_id="r1", prompt_tokens=5, first_token_id=100)
            assert await _stream(both.stub, request) == await _stream(both.grpc_stub, request)
            assert [c.token_ids[0] for c in await _stream(both.stub, request)] == [100, 101, 102, 103, 104]
            reply = await both.stub.Abort(pb.AbortRequest(request_ids=["a", "b"]), timeout=5)
            assert reply == await both.grpc_stub.Abort(pb.AbortRequest(request_ids=["a", "b"]), timeout=5)
            assert reply.aborted == 2
            peers = both.servicer.peers
            assert peers[0] == peers[2] == peers[3] == "unix:fast-lane" and peers[1].startswith("ipv4:127.0.0.1")

    asyncio.run(main())


def test_an_epd_error_comes_back_as_grpc_gives_it():
    """Same status code, message and epd error code in the trailing metadata: the coordinator maps it the same."""
    async def main() -> None:
        async with Both(Servicer()) as both:
            errors = []
            for stub in (both.stub, both.grpc_stub):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Abort(pb.AbortRequest(request_ids=["bad"]), timeout=5)
                trailing = dict(caught.value.trailing_metadata())
                errors.append((caught.value.code(), caught.value.details(), trailing[ERROR_CODE_METADATA_KEY]))
            assert errors[0] == errors[1] == (grpc.StatusCode.INVALID_ARGUMENT, "request id 'bad' is refused",
                                              "bad_request_id")

    asyncio.run(main())


def test_cancel_and_deadline_reach_the_handler():
    async def main() -> None:
        async with Both(Servicer()) as both:
            call = both.stub.Decode(pb.DecodeRequest(request_id="slow", prompt_tokens=100), timeout=10)
            assert (await call.read()).text == "t0"
            call.cancel()
            assert await call.read() is grpc.aio.EOF
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await both.stub.Abort(pb.AbortRequest(request_ids=["sleep"]), timeout=0.2)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(50):
                if sorted(both.servicer.cancelled) == ["sleep", "slow"]:
                    break
                await asyncio.sleep(0.02)
            assert sorted(both.servicer.cancelled) == ["sleep", "slow"]

    asyncio.run(main())


def test_a_role_that_goes_away_fails_its_calls_as_a_transport_failure_and_new_calls_take_grpc():
    async def main() -> None:
        async with Both(Servicer()) as both:
            call = both.stub.Decode(pb.DecodeRequest(request_id="slow", prompt_tokens=100), timeout=10)
            assert (await call.read()).text == "t0"
            await both.fast.close()  # the socket's server and its connections: gone
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ERROR_CODE_METADATA_KEY not in dict(caught.value.trailing_metadata())
            before = len(both.servicer.peers)
            assert (await both.stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)).aborted == 1
            assert both.servicer.peers[before].startswith("ipv4:")  # no socket now: gRPC carried it

    asyncio.run(main())


def test_a_draining_role_refuses_new_calls_and_finishes_running_ones():
    async def main() -> None:
        async with Both(Servicer()) as both:
            call = both.stub.Decode(pb.DecodeRequest(request_id="slow", prompt_tokens=6), timeout=10)
            assert (await call.read()).text == "t0"
            stopping = asyncio.ensure_future(both.fast.stop(5.0))
            await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await both.stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = []
            while (chunk := await call.read()) is not grpc.aio.EOF:
                rest.append(chunk.text)
            assert rest == ["t1", "t2", "t3", "t4", "t5"]
            await stopping

    asyncio.run(main())


def test_which_addresses_may_take_the_fast_lane():
    assert fast_lane_port("127.0.0.1:5001", secure=False) == 5001
    assert fast_lane_port("localhost:5001", secure=False) == 5001
    assert fast_lane_port("[::1]:5001", secure=False) == 5001
    assert fast_lane_port("127.0.0.1:5001", secure=True) is None  # TLS: its peers expect an authenticated transport
    assert fast_lane_port("10.1.2.3:5001", secure=False) is None  # another host
    assert fast_lane_port("127.0.0.1:5001", secure=False, enabled=False) is None  # --fast-lane off


def test_a_socket_that_answers_for_another_port_is_not_used(tmp_path):
    async def main() -> None:
        async with Both(Servicer()) as both:
            other = free_port()
            fastlane.socket_path(other).symlink_to(fastlane.socket_path(both.port))  # a stale or foreign socket
            stub = with_fast_lane(both.grpc_stub, f"127.0.0.1:{other}", secure=False)
            assert (await stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)).aborted == 1
            assert both.servicer.peers[-1].startswith("ipv4:")  # HELLO named another port: gRPC carried it
            await stub.close()

    asyncio.run(main())


def test_a_request_header_round_trips_and_a_cut_one_is_refused():
    import struct

    body = pb.AbortRequest(request_ids=["a"]).SerializeToString()
    for timeout in (None, 2.5, float("inf")):
        payload = fastlane.request_payload(METHOD, [("x-request-id", "r-é1"), ("k", "")],
                                           timeout, body)
        assert fastlane.parse_request(payload) == (METHOD,
                                                   [("x-request-id", "r-é1"), ("k", "")], timeout, body)
    payload = fastlane.request_payload(METHOD, [("x-request-id", "r1")], 1.0, b"")
    for cut in (payload[:5], payload[:12], payload[:-1]):
        with pytest.raises((ValueError, struct.error)):
            fastlane.parse_request(cut)


def test_a_malformed_request_is_answered_internal_and_the_connection_serves_on():
    """A frame whose header is cut short gets an ERROR (INTERNAL, "malformed fast-lane request"); the next call
    on the same connection is served."""
    import json

    async def call(reader, writer, call_id: int, payload: bytes) -> tuple[int, int, bytes]:
        writer.write(fastlane.frame(fastlane.REQUEST, call_id, payload))
        size, kind, got_id = fastlane.HEADER.unpack(await reader.readexactly(fastlane.HEADER.size))
        return kind, got_id, await reader.readexactly(size)

    async def main() -> None:
        async with Both(Servicer()) as both:
            reader, writer = await asyncio.open_unix_connection(str(fastlane.socket_path(both.port)))
            size, kind, _ = fastlane.HEADER.unpack(await reader.readexactly(fastlane.HEADER.size))
            assert kind == fastlane.HELLO and json.loads(await reader.readexactly(size)) == {"grpc_port": both.port}
            good = fastlane.request_payload(METHOD, [("x-request-id", "r1")], 5.0,
                                            pb.AbortRequest(request_ids=["a", "b", "c"]).SerializeToString())
            kind, call_id, payload = await call(reader, writer, 7, good[:11])
            assert (kind, call_id) == (fastlane.ERROR, 7)
            assert json.loads(payload) == {"code": grpc.StatusCode.INTERNAL.value[0],
                                           "details": "malformed fast-lane request", "trailing": []}
            kind, call_id, payload = await call(reader, writer, 8, good)
            assert (kind, call_id) == (fastlane.REPLY, 8) and pb.AbortResponse.FromString(payload).aborted == 3
            writer.close()

    asyncio.run(main())
