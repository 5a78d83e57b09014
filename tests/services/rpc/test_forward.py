"""Answers forwarded role to role (FORWARD, TOKEN_INPUTS, REPLY_FORWARDED: services/rpc/fastlane_forward.py and
services/rpc/relay.py), over two real fast-lane servers, each a real gRPC port's: prefill's answer goes from one
straight to a Decode stream opened ahead on the other; the caller still gets every answer."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from services.rpc import fastlane
from services.rpc import fastlane_forward as fwd
from services.rpc.fastlane_client import Relay
from services.rpc.v1 import epd_pb2 as pb
from services.server import free_port
from tests.services.rpc.test_inputs_follow import Served


@pytest.fixture(autouse=True)
def socket_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(fastlane.ENV_DIR, str(tmp_path))


def _forwarded(outcome: str) -> float:
    return fwd.FORWARDED.labels(outcome)._value.get()


def _decode_ahead(served: Served, request_id: str = "d1", token: bytes | None = None):
    call = served.decode.open_ahead("Decode", pb.DecodeRequest(request_id=request_id, prompt_tokens=2,
                                                                inputs_follow_ms=5000), timeout=10, token=token)
    assert call is not None and call.token is not None and call.port == served.port
    return call


def _prefill_ahead(served: Served, request_id: str = "p1"):
    return served.prefill.open_ahead("Prefill", pb.PrefillRequest(request_id=request_id, token_ids=[5, 6, 7],
                                                                   inputs_follow_ms=5000), timeout=10)


HANDLES = pb.EncodeResponse(items=[pb.EncodedItem(mm_hash="h", handle_json=b"kv")])


async def _prefill_answer_aimed_at_decode(a: Served, b: Served, request_id: str = "p1", port: int | None = None):
    """Prefill's call on `a` and decode's on `b`, both opened ahead; prefill told (a FORWARD) to send its answer on
    to decode's call (at `port` instead, to aim elsewhere); prefill's inputs sent and its answer read."""
    decode, prefill = _decode_ahead(b), _prefill_ahead(a, request_id)
    if port is not None:
        decode.port = port
    relay = Relay()
    assert prefill.relay_answer(relay)
    relay.aim(decode)   # a FORWARD, read by prefill's role before its inputs come
    await asyncio.sleep(0.05)
    prefill.send_inputs(HANDLES)
    return decode, await prefill.answer()


async def _tokens(decode) -> list[tuple[int, str]]:
    chunks = [await decode.stream.read(), await decode.stream.read()]
    assert await decode.stream.read() is grpc.aio.EOF
    return [(c.token_ids[0], c.text) for c in chunks]


async def _open_peer(source: Served, target: Served) -> None:
    """The source role's connection to the target's socket, as a first FORWARD naming it opens it."""
    source.fast.forwarder.prepare(target.port)
    for _ in range(100):
        if source.fast.forwarder._peers[target.port].ready() is not None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the forwarding connection did not open")


def test_an_answer_goes_from_its_role_straight_to_the_next_roles_call():
    async def main() -> None:
        async with Served() as a, Served() as b:
            await _open_peer(a, b)
            sent = _forwarded("sent")
            decode, answer = await _prefill_answer_aimed_at_decode(a, b)
            assert answer.first_token_id == 3 and answer.kv_transfer_params_json == b"h=kv"   # the caller's answer
            assert decode.forwarded and decode.sent and _forwarded("sent") == sent + 1
            assert await _tokens(decode) == [(3, "h=kv"), (4, "h=kv")]

    asyncio.run(main())


def test_a_forward_to_a_role_that_cannot_be_reached_is_relayed_by_the_caller():
    async def main() -> None:
        async with Served() as a, Served() as b:
            unreachable = _forwarded("unreachable")
            # no socket there: the role answers a plain REPLY
            decode, _ = await _prefill_answer_aimed_at_decode(a, b, port=free_port())
            assert decode.relayed and not decode.forwarded and _forwarded("unreachable") == unreachable + 1
            assert await _tokens(decode) == [(3, "h=kv"), (4, "h=kv")]

    asyncio.run(main())


def test_a_call_reserved_ahead_gets_the_answer_forwarded_before_it_opens():
    """The coordinator tells a role where its answer goes before the call that will take it is open (a reserved
    token): the answer waits in the target role, and the call that names the token later gets it at once."""
    async def main() -> None:
        async with Served() as a, Served() as b:
            await _open_peer(a, b)
            token = os.urandom(fastlane.TOKEN_BYTES)
            prefill = _prefill_ahead(a)
            assert prefill.forward_to(b.port, token)
            prefill.send_inputs(HANDLES)
            await prefill.answer()
            for _ in range(100):
                if b.fast.forwarder.early:
                    break
                await asyncio.sleep(0.01)
            assert b.fast.forwarder.early == 1   # kept for the call about to name it
            decode = _decode_ahead(b, token=token)
            assert await _tokens(decode) == [(3, "h=kv"), (4, "h=kv")]
            assert b.fast.forwarder.early == 0

    asyncio.run(main())


def test_an_answer_forwarded_to_another_token_than_the_relays_target_is_relayed_as_well():
    async def main() -> None:
        async with Served() as a, Served() as b:
            await _open_peer(a, b)
            prefill, decode = _prefill_ahead(a), _decode_ahead(b)
            assert prefill.forward_to(b.port, os.urandom(fastlane.TOKEN_BYTES))   # reserved, then not used
            relay = Relay(target=decode)
            relay.shape = bytes   # a shaped answer is never forwarded: the coordinator relays it
            prefill.relay_answer(relay)
            prefill.send_inputs(HANDLES)
            await prefill.answer()
            assert decode.relayed and not decode.forwarded
            assert await _tokens(decode) == [(3, "h=kv"), (4, "h=kv")]
            assert b.fast.forwarder.early == 1   # the forwarded copy, for a call that never names its token

    asyncio.run(main())


def test_a_forward_for_no_running_call_is_ignored_and_the_connection_carries_on():
    async def main() -> None:
        async with Served() as a:
            connection = await a.prefill.connection()
            connection.writer.write(fastlane.frame(fastlane.FORWARD, 4242, fastlane.forward_payload(
                a.port, os.urandom(fastlane.TOKEN_BYTES))))
            answer = await a.prefill.Prefill(pb.PrefillRequest(request_id="p", token_ids=[1],
                                                               ec_transfer_params_json=b"x"), timeout=10)
            assert answer.kv_transfer_params_json == b"x" and not connection.closed

    asyncio.run(main())


def test_inputs_kept_for_a_call_not_open_yet_are_bounded_in_count_and_time(monkeypatch):
    async def main() -> None:
        forwarder = fwd.Forwarder()
        monkeypatch.setattr(fwd, "EARLY_MAX", 3)
        tokens = [bytes([i]) * fastlane.TOKEN_BYTES for i in range(5)]
        for i, token in enumerate(tokens):
            forwarder.deliver(token, b"inputs %d" % i)
        assert forwarder.early == 3   # the two oldest dropped
        loop = asyncio.get_running_loop()
        gone, kept = loop.create_future(), loop.create_future()
        forwarder.expect(tokens[0], gone)
        forwarder.expect(tokens[4], kept)
        assert not gone.done() and kept.result() == b"inputs 4"
        monkeypatch.setattr(fwd, "EARLY_TTL_S", 0.0)
        forwarder.deliver(os.urandom(fastlane.TOKEN_BYTES), b"expires at once")
        forwarder.deliver(os.urandom(fastlane.TOKEN_BYTES), b"x")   # the expired one goes as this comes
        assert forwarder.early == 3   # tokens 2 and 3, and this one
        forwarder.deliver(tokens[0], b"second")   # to the call waiting for it; a second one is dropped
        forwarder.deliver(tokens[0], b"third")
        assert gone.result() == b"second"
        await forwarder.close()

    asyncio.run(main())


def test_a_call_that_ended_forgets_its_token():
    async def main() -> None:
        forwarder = fwd.Forwarder()
        waiting = asyncio.get_running_loop().create_future()
        forget = forwarder.expect(b"t" * fastlane.TOKEN_BYTES, waiting)
        forget()
        forwarder.deliver(b"t" * fastlane.TOKEN_BYTES, b"late")
        assert not waiting.done() and forwarder.early == 1
        await forwarder.close()

    asyncio.run(main())


def test_the_roles_forwarded_to_are_bounded_the_least_recently_named_closed(monkeypatch):
    async def main() -> None:
        monkeypatch.setattr(fwd, "MAX_PEERS", 2)
        forwarder = fwd.Forwarder()
        ports = [free_port() for _ in range(3)]   # no socket behind them: each connect fails at once
        forwarder.prepare(ports[0])
        forwarder.prepare(ports[1])
        forwarder.prepare(ports[0])   # named again: now the most recent
        forwarder.prepare(ports[2])
        assert list(forwarder._peers) == [ports[0], ports[2]]
        await forwarder.close()

    asyncio.run(main())


def test_work_left_for_after_an_answer_runs_after_it_and_before_the_answer_goes_on():
    """context.after_reply (prefill leaves its KV copy there, the entry's handle already in the answer): with a
    forward, the caller's answer goes first, then the work, then the answer on to the next role, which may read
    what the work made; without one, the work runs before the answer (the caller may send it on itself); a call
    that fails leaves the work told so (done(False): the reserved entry is given back)."""
    async def main() -> None:
        async with Served() as a, Served() as b:
            await _open_peer(a, b)
            decode, _ = await _prefill_answer_aimed_at_decode(a, b, "defer1")
            assert decode.forwarded
            assert await _tokens(decode) == [(3, "h=kv"), (4, "h=kv")]
            worked, inputs = dict(a.roles.events)["prefill.after_reply.True"], dict(b.roles.events)["decode.inputs"]
            assert worked < inputs

            alone = _prefill_ahead(a, "defer2")   # no forward: the work, then the answer
            alone.send_inputs(HANDLES)
            await alone.answer()
            answered = asyncio.get_running_loop().time()
            assert [n for n, _ in a.roles.events].count("prefill.after_reply.True") == 2
            assert a.roles.events[-1][1] < answered

            failing = _prefill_ahead(a, "defer-fail")
            failing.send_inputs(HANDLES)
            with pytest.raises(grpc.aio.AioRpcError):
                await failing.answer()
            assert a.roles.events[-1][0] == "prefill.after_reply.False"

    asyncio.run(main())
