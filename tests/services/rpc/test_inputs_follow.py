"""Calls opened ahead of their inputs (services/rpc/inputs_follow.py, the fast lane's INPUTS frame, AheadCall and
Relay in services/rpc/fastlane_client.py), over a real fast lane and a real gRPC port.  The servicers are test
ones with the production shapes: Prefill (unary) reads an EncodeResponse as its inputs, Decode (a stream) reads
a PrefillResponse, both behind the real rpc_method / rpc_stream wrappers; each notes when its request came and
when its inputs did, so a test knows the handler ran before the inputs existed."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.protocol.errors import ERROR_CODE_METADATA_KEY, InvalidRequest
from services.rpc import fastlane
from services.rpc.fastlane_client import AheadCall, FastLaneStub, Relay, with_fast_lane
from services.rpc.fastlane_server import FastLaneServer
from services.rpc.handlers import RPC_SECONDS, rpc_method, rpc_stream
from services.rpc.inputs_follow import check_can_follow, inputs_that_follow
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc
from services.server import free_port


class Roles(rpc.PrefillServiceServicer, rpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self.cancelled: list[str] = []

    @rpc_method
    async def Prefill(self, request: pb.PrefillRequest, context):
        self.events.append(("prefill.request", time.monotonic()))
        handles = request.ec_transfer_params_json.decode()
        if request.inputs_follow_ms:
            check_can_follow(context, "Prefill")
            try:
                encoded = await inputs_that_follow(context, request.inputs_follow_ms, pb.EncodeResponse, "Prefill")
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                raise
            self.events.append(("prefill.inputs", time.monotonic()))
            handles = ",".join(f"{i.mm_hash}={i.handle_json.decode()}" for i in encoded.items)
        if request.request_id.startswith("defer"):   # work left for after the answer (context.after_reply)
            context.after_reply(lambda answered: self.events.append((f"prefill.after_reply.{answered}",
                                                                     time.monotonic())))
            if request.request_id == "defer-fail":
                raise InvalidRequest("refused after leaving work for later", code="invalid_request")
        return pb.PrefillResponse(request_id=request.request_id, first_token_id=len(request.token_ids),
                                  kv_transfer_params_json=handles.encode(), prompt_tokens=len(request.token_ids))

    @rpc_stream
    async def Decode(self, request: pb.DecodeRequest, context):
        self.events.append(("decode.request", time.monotonic()))
        first, kv = request.first_token_id, request.kv_transfer_params_json
        if request.inputs_follow_ms:
            check_can_follow(context, "Decode")
            answer = await inputs_that_follow(context, request.inputs_follow_ms, pb.PrefillResponse, "Decode")
            self.events.append(("decode.inputs", time.monotonic()))
            first, kv = answer.first_token_id, answer.kv_transfer_params_json
        for i in range(request.prompt_tokens):
            yield pb.DecodeChunk(token_ids=[first + i], text=kv.decode())


class Served:
    """Both services on a gRPC port and on its fast lane; fast-lane stubs and a plain gRPC one for Prefill."""

    async def __aenter__(self) -> Served:
        self.roles = Roles()

        def register(server):
            rpc.add_PrefillServiceServicer_to_server(self.roles, server)
            rpc.add_DecodeServiceServicer_to_server(self.roles, server)

        self.server = grpc.aio.server()
        register(self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await self.server.start()
        self.fast = FastLaneServer.from_registration(register, self.port)
        await self.fast.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.grpc_prefill = rpc.PrefillServiceStub(self.channel)
        address = f"127.0.0.1:{self.port}"
        self.prefill = with_fast_lane(self.grpc_prefill, address, secure=False)
        self.decode = with_fast_lane(rpc.DecodeServiceStub(self.channel), address, secure=False)
        assert isinstance(self.prefill, FastLaneStub) and isinstance(self.decode, FastLaneStub)
        await self.prefill.connection()   # a call opens ahead only on an open connection
        await self.decode.connection()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.prefill.close()
        await self.decode.close()
        await self.fast.close()
        await self.channel.close()
        await self.server.stop(None)


@pytest.fixture(autouse=True)
def socket_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(fastlane.ENV_DIR, str(tmp_path))


def _code(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    return error.code(), dict(error.trailing_metadata())[ERROR_CODE_METADATA_KEY]


def _rpc_seconds(method: str) -> float:
    return RPC_SECONDS.labels(method)._sum.get()


def test_a_unary_call_opened_ahead_runs_before_its_inputs_and_answers_with_them():
    async def main() -> None:
        async with Served() as served:
            before = _rpc_seconds("Prefill")
            ahead = served.prefill.open_ahead("Prefill", pb.PrefillRequest(request_id="p1", token_ids=[1, 2, 3],
                                                                             inputs_follow_ms=5000), timeout=10)
            assert isinstance(ahead, AheadCall)
            await asyncio.sleep(0.3)   # the stage before it "computes"
            assert [name for name, _ in served.roles.events] == ["prefill.request"]   # parsed, waiting
            ahead.send_inputs(pb.EncodeResponse(items=[pb.EncodedItem(mm_hash="h1", handle_json=b'{"k":1}')]))
            answer = await ahead.answer()
            assert (answer.first_token_id, answer.kv_transfer_params_json) == (3, b'h1={"k":1}')
            # the role's own time, without the 0.3 s it waited for the inputs
            assert _rpc_seconds("Prefill") - before < 0.2

    asyncio.run(main())


def test_a_relay_hands_an_answer_on_before_its_caller_wakes():
    """Prefill's whole call relays its answer to a Decode stream opened ahead: by the time the Prefill caller has
    its answer, the Decode call has been sent it (the coordinator's connection forwarded it as it read it)."""
    async def main() -> None:
        async with Served() as served:
            decode = served.decode.open_ahead("Decode", pb.DecodeRequest(request_id="d1", prompt_tokens=2,
                                                                           inputs_follow_ms=5000), timeout=10)
            assert decode is not None and decode.stream is not None
            relay = Relay(target=decode)
            answer = await served.prefill.Prefill(pb.PrefillRequest(request_id="p1", token_ids=[5, 6],
                                                                    ec_transfer_params_json=b"kv!"),
                                                  timeout=10, relay=relay)
            assert decode.sent and decode.relayed   # before this task woke for the answer
            decode.send_inputs(pb.PrefillResponse(first_token_id=999))   # later sends do nothing
            chunks = [await decode.stream.read(), await decode.stream.read()]
            assert await decode.stream.read() is grpc.aio.EOF
            assert [(c.token_ids[0], c.text) for c in chunks] == [(2, "kv!"), (3, "kv!")] and answer.first_token_id == 2

    asyncio.run(main())


def test_a_relay_sends_nothing_for_an_error_answer_and_the_step_sends_the_inputs_itself():
    async def main() -> None:
        async with Served() as served:
            decode = served.decode.open_ahead("Decode", pb.DecodeRequest(request_id="d1", prompt_tokens=1,
                                                                           inputs_follow_ms=5000), timeout=10)
            relay = Relay(target=decode)
            with pytest.raises(grpc.aio.AioRpcError) as failed:   # a Prefill opened ahead whose inputs never come
                await served.prefill.Prefill(pb.PrefillRequest(request_id="p1", token_ids=[1], inputs_follow_ms=50),
                                             timeout=10, relay=relay)
            assert _code(failed.value) == (grpc.StatusCode.DEADLINE_EXCEEDED, "inputs_timeout")
            assert not decode.sent
            decode.send_inputs(pb.PrefillResponse(first_token_id=7, kv_transfer_params_json=b"x"))
            assert (await decode.stream.read()).token_ids == [7]

    asyncio.run(main())


def test_inputs_that_never_come_end_the_call_within_their_bound():
    async def main() -> None:
        async with Served() as served:
            ahead = served.prefill.open_ahead("Prefill", pb.PrefillRequest(request_id="p1", token_ids=[1],
                                                                             inputs_follow_ms=100), timeout=10)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await ahead.answer()
            assert time.monotonic() - started < 5
            assert _code(failed.value) == (grpc.StatusCode.DEADLINE_EXCEEDED, "inputs_timeout")
            assert "did not follow within 100 ms" in failed.value.details()

    asyncio.run(main())


def test_inputs_that_are_not_the_message_are_refused():
    async def main() -> None:
        async with Served() as served:
            ahead = served.prefill.open_ahead("Prefill", pb.PrefillRequest(request_id="p1", token_ids=[1],
                                                                             inputs_follow_ms=5000), timeout=10)
            ahead.send_raw(b"\xff\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await ahead.answer()
            assert _code(failed.value) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_inputs")
            assert failed.value.details() == "the inputs of this Prefill call are not a EncodeResponse"

    asyncio.run(main())


def test_over_grpc_a_request_whose_inputs_follow_is_refused_at_once():
    async def main() -> None:
        async with Served() as served:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await served.grpc_prefill.Prefill(pb.PrefillRequest(request_id="p1", token_ids=[1],
                                                                    inputs_follow_ms=60_000), timeout=5)
            assert _code(failed.value) == (grpc.StatusCode.INVALID_ARGUMENT, "inputs_follow_unsupported")
            assert served.roles.events and len(served.roles.events) == 1   # refused before any waiting

    asyncio.run(main())


def test_cancelling_a_call_opened_ahead_cancels_its_handler_and_a_closed_connection_fails_it():
    async def main() -> None:
        async with Served() as served:
            ahead = served.prefill.open_ahead("Prefill", pb.PrefillRequest(request_id="gone", token_ids=[1],
                                                                             inputs_follow_ms=60_000), timeout=60)
            await asyncio.sleep(0.1)
            ahead.cancel()
            ahead.send_inputs(pb.EncodeResponse())   # after the end: nothing is sent
            for _ in range(100):
                if served.roles.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert served.roles.cancelled == ["gone"]

            other = served.prefill.open_ahead("Prefill", pb.PrefillRequest(request_id="p2", token_ids=[1],
                                                                             inputs_follow_ms=60_000), timeout=60)
            await served.fast.close()   # the role goes away with the call open
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(other.answer(), 10)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert served.prefill.open_ahead("Prefill", pb.PrefillRequest(request_id="p3"), timeout=5) is None

    asyncio.run(main())


def test_a_relay_that_fails_loses_only_the_shortcut():
    """A named fault (a relay that cannot shape the answer; for real its target's connection would be going away):
    the caller still gets its answer, the connection carries on, and the step sends the inputs itself."""
    async def main() -> None:
        async with Served() as served:
            decode = served.decode.open_ahead("Decode", pb.DecodeRequest(request_id="d1", prompt_tokens=1,
                                                                           inputs_follow_ms=5000), timeout=10)
            relay = Relay(target=decode)
            relay.shape = lambda raw: 1 / 0
            whole = pb.PrefillRequest(request_id="p1", token_ids=[4, 5], ec_transfer_params_json=b"kv")
            answer = await served.prefill.Prefill(whole, timeout=10, relay=relay)
            assert answer.first_token_id == 2 and not decode.sent
            assert (await served.prefill.Prefill(whole, timeout=10)).first_token_id == 2   # the same connection
            decode.send_inputs(answer)
            assert (await decode.stream.read()).token_ids == [2]

    asyncio.run(main())



def test_a_calls_metrics_are_recorded_on_the_loops_next_turn_after_it_answered():
    """rpc_method times the call when the handler returns and records its counters on the loop's next turn, so the
    server writes the answer first (the next role wakes for it before the bookkeeping runs)."""
    from services.rpc.handlers import RPC_REQUESTS

    class Context:
        waited_s = 0.0

        def invocation_metadata(self):
            return (("x-request-id", "r1"),)

    class Servicer:
        @rpc_method
        async def Prefill(self, request, context):
            return "answer"

    async def main() -> tuple[float, float, float]:
        counted = RPC_REQUESTS.labels("Prefill", "ok")
        before = counted._value.get()
        assert await Servicer().Prefill(pb.PrefillRequest(request_id="r1"), Context()) == "answer"
        at_answer = counted._value.get()
        await asyncio.sleep(0)
        return before, at_answer, counted._value.get()

    before, at_answer, after = asyncio.run(main())
    assert at_answer == before and after == before + 1
