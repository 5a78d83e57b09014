"""The fast lane (services/rpc/fastlane*.py) against gRPC, both real: one servicer served on a gRPC port and on
its Unix socket, called through the coordinator's stub.  The servicer is a test one (DecodeService's shapes: a
server stream and a unary call, behind the real rpc_stream / rpc_method wrappers); it notes the peer of each
call, so every test knows which transport carried it.  The lane's safety (a private socket folder, the peer's
user checked at both ends, bounded frames and calls) is tried with real sockets, another user's included."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import grpc
import pytest

from services.private_dir import PrivateDirError
from services.protocol.errors import ERROR_CODE_METADATA_KEY, InvalidRequest
from services.rpc import fastlane
from services.rpc.fastlane_client import FastLaneStub, fast_lane_port, with_fast_lane
from services.rpc.fastlane_server import FastLaneServer
from services.rpc.handlers import rpc_method, rpc_stream
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc
from services.server import free_port

INSTANCE = "inst1"
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
            lambda s: rpc.add_DecodeServiceServicer_to_server(self.servicer, s), self.port, INSTANCE)
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
    monkeypatch.setenv(fastlane.ENV_DIR, str(tmp_path / "lane"))   # made 0700 by the first use


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
            # a stale or foreign socket: it answers HELLO for both.port
            fastlane.socket_path(other, "old").symlink_to(fastlane.socket_path(both.port, INSTANCE))
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
            reader, writer = await asyncio.open_unix_connection(str(fastlane.socket_path(both.port, INSTANCE)))
            size, kind, _ = fastlane.HEADER.unpack(await reader.readexactly(fastlane.HEADER.size))
            assert kind == fastlane.HELLO
            assert json.loads(await reader.readexactly(size)) == {"grpc_port": both.port, "instance_id": INSTANCE}
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


def test_the_socket_folder_must_be_this_users_alone(tmp_path, monkeypatch):
    """A folder open to others, or a symlink to one, is refused by the role (it serves gRPC only) and by the
    coordinator (its calls take gRPC): nobody else can place or reach a socket there."""
    import os

    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "lane")
    (tmp_path / "lane").mkdir(mode=0o700)
    for folder in (open_dir, link):
        monkeypatch.setenv(fastlane.ENV_DIR, str(folder))
        with pytest.raises(PrivateDirError):
            fastlane.socket_dir()
        with pytest.raises(PrivateDirError):
            asyncio.run(FastLaneServer({}, 1234, INSTANCE).start())
    monkeypatch.setenv(fastlane.ENV_DIR, str(tmp_path / "fresh"))
    assert os.stat(fastlane.socket_dir()).st_mode & 0o777 == 0o700


def test_a_frame_over_the_bound_closes_the_connection_before_its_body_is_read():
    async def main() -> bytes:
        async with Both(Servicer()) as both:
            reader, writer = await asyncio.open_unix_connection(str(fastlane.socket_path(both.port, INSTANCE)))
            size, _, _ = fastlane.HEADER.unpack(await reader.readexactly(fastlane.HEADER.size))
            await reader.readexactly(size)   # HELLO
            writer.write(fastlane.HEADER.pack(fastlane.MAX_FRAME + 1, fastlane.REQUEST, 1))   # no body follows
            rest = await asyncio.wait_for(reader.read(), 5)   # closed at once: EOF, not a wait for 256 MiB
            writer.close()
            assert (await both.stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)).aborted == 1
            return rest

    assert asyncio.run(main()) == b""


def test_calls_past_the_bound_of_one_connection_are_refused_as_overloaded(monkeypatch):
    """The role refuses them as a full role refuses (the coordinator tries another instance or answers 429)."""
    monkeypatch.setattr(fastlane, "MAX_CALLS", 2)

    async def main() -> tuple[list, grpc.aio.AioRpcError]:
        async with Both(Servicer()) as both:
            held = [asyncio.ensure_future(both.stub.Abort(pb.AbortRequest(request_ids=["sleep"]), timeout=5))
                    for _ in range(2)]
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await both.stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)
            for call in held:
                call.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            return both.servicer.peers, caught.value

    peers, err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.trailing_metadata())[ERROR_CODE_METADATA_KEY] == "overloaded"
    assert peers == ["unix:fast-lane", "unix:fast-lane"]


def _as_nobody(code: str) -> subprocess.Popen:
    """A Python child running `code` (standard library only) as uid/gid 65534 (nobody): another local user.  The
    system's python3, which that user may run (this venv's may sit under root's home)."""
    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
    return subprocess.Popen([python, "-I", "-c", code], preexec_fn=drop, stdout=subprocess.PIPE, text=True,
                            cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's process needs root (CI runs as root)")
def test_another_users_process_is_refused_at_both_ends(tmp_path):
    """SO_PEERCRED: a client of another user reaching the role's socket (by a hard link outside the private
    folder) gets no HELLO; a socket of another user's process found in the folder is not connected to (the call
    takes gRPC)."""
    import tempfile
    from pathlib import Path

    shared = Path(tempfile.mkdtemp(prefix="epd-peer-", dir="/tmp"))   # a folder both users reach
    shared.chmod(0o777)

    async def main() -> tuple[str, str]:
        async with Both(Servicer()) as both:
            os.link(fastlane.socket_path(both.port, INSTANCE), shared / "role.sock")
            os.chmod(shared / "role.sock", 0o777)   # reachable by anyone: the peer check alone stands between
            client = _as_nobody(
                "import socket; s=socket.socket(socket.AF_UNIX);"
                f"s.connect({str(shared / 'role.sock')!r}); s.settimeout(5); print(repr(s.recv(64)))")
            said = await asyncio.to_thread(lambda: client.communicate(timeout=30)[0].strip())
            other = free_port()
            server = _as_nobody(
                "import socket,time; s=socket.socket(socket.AF_UNIX);"
                f"s.bind({str(shared / 'evil.sock')!r}); s.listen(); print('up', flush=True);"
                "c,_=s.accept(); time.sleep(30)")
            assert server.stdout is not None and server.stdout.readline().strip() == "up"
            os.link(shared / "evil.sock", fastlane.socket_path(other, "evil"))
            stub = with_fast_lane(both.grpc_stub, f"127.0.0.1:{other}", secure=False)
            try:
                assert (await stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)).aborted == 1
            finally:
                server.kill()
                await stub.close()
            return said, both.servicer.peers[-1]

    try:
        said, peer = asyncio.run(main())
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert said == "b''"                  # connection closed with no HELLO: nothing of the role was read
    assert peer.startswith("ipv4:")       # the foreign socket was refused: gRPC carried the call
