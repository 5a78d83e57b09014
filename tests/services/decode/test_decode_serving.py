"""DecodeService over a real shm KV store: the prefilled KV is opened by handle and checked before anything is
emitted, the first token (prefill's) goes out at once, and the entry is copied once into the engine's blocks
beside it (on the event loop when small: two thread wake-ups cost more than the copy; in a worker thread when
large); the tokens are Hugging Face's either way, and every block and entry comes back however it ends."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from services.connectors import StoreConfig, create_store, wiring
from services.decode.serving import DecodeService
from services.protocol.errors import InvalidRequest, NotFound

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class NotingViews:
    """The real store, noting which thread opened each view."""

    def __init__(self, inner) -> None:
        self.inner, self.threads = inner, []

    def view(self, handle):
        self.threads.append(threading.get_ident())
        return self.inner.view(handle)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def store():
    store = create_store(StoreConfig("shm", "kv", "t" + uuid.uuid4().hex[:12], capacity_bytes=16 << 20))
    yield store
    store.close()


@pytest.fixture(scope="module")
def story(tiny):
    return tiny.prefill_text(tiny.chat_ids("Tell me a story about a cat."))


def transfer(store, prefilled, key="req|d1|x") -> dict:
    return {"handle": store.put(key, {"kv": prefilled.kv}), "num_prompt_tokens": prefilled.prompt_len,
            "rope_delta": prefilled.rope_delta, "first_token_id": prefilled.first_token}


async def collect(events, on_event=None) -> list:
    out = []
    async for event in events:
        out.append(event)
        if on_event is not None:
            await on_event(event)
    return out


def all_back(engine) -> bool:
    kv = engine.stats().kv
    return (kv.used_blocks, kv.reserved_blocks) == (0, 0)


def hold_loads(engine) -> tuple[threading.Event, threading.Event]:
    """The engine's KV copies wait for `release` (a named fake for the timing); `entered` says one began."""
    entered, release = threading.Event(), threading.Event()
    load = engine.load

    def held_load(*args):
        entered.set()
        assert release.wait(30)
        load(*args)

    engine.load = held_load
    return entered, release


def wait_until(check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("inline_bytes", [wiring.INLINE_BYTES, 0])
def test_the_kv_is_copied_on_the_loop_when_small_else_in_a_thread(tiny, make_engine, story, store, monkeypatch,
                                                                  inline_bytes):
    monkeypatch.setattr(wiring, "INLINE_BYTES", inline_bytes)
    params = transfer(store, story)
    assert params["handle"]["length"] <= wiring.INLINE_BYTES or inline_bytes == 0
    engine = make_engine(num_slots=2)
    loads: list[int] = []
    load = engine.load
    engine.load = lambda *args: (loads.append(threading.get_ident()), load(*args))[1]
    service = DecodeService(engine, NotingViews(store))

    async def main():
        events = await collect(service.decode("d1", params, {**GREEDY, "max_tokens": 12}))
        return events, threading.get_ident()

    events, loop_thread = asyncio.run(main())
    assert [t for e in events for t in e.token_ids] == tiny.reference(story, 12)
    assert service.kv_store.threads == [loop_thread]          # a local store's view is opened on the loop
    assert len(loads) == 1 and (loads[0] == loop_thread) is (inline_bytes > 0)
    assert store.stats().entries == 0 and all_back(engine)    # the one-shot entry released, blocks back
    assert engine.stats().kv_bytes_copied == story.kv.numel() * 4  # one copy


def test_the_first_token_goes_out_before_the_kv_is_copied(tiny, make_engine, story, store, monkeypatch):
    """The copy is held on purpose (a named fake for the timing): the first token still arrives, and the rest
    follow once the copy is done, equal to Hugging Face's."""
    monkeypatch.setattr(wiring, "INLINE_BYTES", 0)  # the copy in a thread, so it can be held
    engine = make_engine(num_slots=2)
    _, release = hold_loads(engine)
    service = DecodeService(engine, store)

    async def main():
        stream = service.decode("d1", transfer(store, story), {**GREEDY, "max_tokens": 10})
        first = await asyncio.wait_for(anext(stream), 10)
        copied_first = release.is_set()
        release.set()
        return copied_first, [first, *await collect(stream)]

    copied_first, events = asyncio.run(main())
    assert not copied_first   # the first token came out while the copy was held
    assert events[0].token_ids == [story.first_token]
    assert [t for e in events for t in e.token_ids] == tiny.reference(story, 10)
    assert store.stats().entries == 0 and all_back(engine)


def test_a_request_that_leaves_while_its_kv_is_copied_frees_everything(make_engine, story, store, monkeypatch):
    monkeypatch.setattr(wiring, "INLINE_BYTES", 0)
    engine = make_engine(num_slots=2)
    entered, release = hold_loads(engine)
    service = DecodeService(engine, store)

    async def main():
        stream = service.decode("d1", transfer(store, story), {**GREEDY, "max_tokens": 30})
        await anext(stream)
        assert await asyncio.to_thread(entered.wait, 30)
        await stream.aclose()          # the caller leaves while the copy is running
        assert not all_back(engine)    # its blocks are still being written: not freed under the copy
        release.set()
        deadline = time.monotonic() + 30
        while not (all_back(engine) and store.stats().entries == 0):
            assert time.monotonic() < deadline, "the blocks or the entry never came back"
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.stats().steps == 0   # ended at its start, never stepped


def test_a_missing_entry_is_a_typed_error_before_any_token(make_engine, story, store):
    engine = make_engine(num_slots=2)
    params = transfer(store, story)
    store.delete(params["handle"]["key"])
    service = DecodeService(engine, store)

    async def main():
        return await collect(service.decode("d1", params, {**GREEDY, "max_tokens": 5}))

    with pytest.raises(NotFound) as err:
        asyncio.run(main())
    assert err.value.code == "kv_entry_missing"   # the coordinator prefills again
    assert all_back(engine)


def test_a_first_token_that_ends_the_request_copies_nothing(make_engine, story, store):
    engine = make_engine(num_slots=2)
    loads = []
    engine.load = lambda *args: loads.append(args)
    service = DecodeService(engine, store)

    async def main():
        return await collect(service.decode("d1", transfer(store, story), {**GREEDY, "max_tokens": 1}))

    events = asyncio.run(main())
    assert [e.token_ids for e in events] == [[story.first_token]] and events[-1].finish_reason == "length"
    wait_until(lambda: store.stats().entries == 0)   # released unread: its producer frees it
    assert loads == [] and all_back(engine)


@pytest.mark.parametrize("sent", [1, 3, 8])
def test_a_resumed_request_goes_on_after_the_tokens_its_client_has(tiny, make_engine, story, store, sent):
    """The KV of the prompt and the first `sent - 1` output tokens, the `sent` tokens named as resumed: none is
    emitted again, the next ones are Hugging Face's, counted from where the client is; a budget they already
    used up ends at once, with no token."""
    engine = make_engine(num_slots=2)
    service = DecodeService(engine, store)
    ref = tiny.reference(story, 8)
    ids = tiny.chat_ids("Tell me a story about a cat.")
    again = tiny.prefill_text(ids + ref[:sent - 1])

    async def main():
        return await collect(service.decode("d1", transfer(store, again), {**GREEDY, "max_tokens": 8},
                                            resumed=ref[:sent]))

    events = asyncio.run(main())
    assert [t for e in events for t in e.token_ids] == ref[sent:]
    assert [e.completion_tokens for e in events] == (list(range(sent + 1, 9)) if sent < 8 else [8])
    assert events[-1].finish_reason == "length"
    wait_until(lambda: store.stats().entries == 0)
    assert all_back(engine)


def test_resumed_tokens_that_do_not_fit_the_kv_are_refused(make_engine, story, store):
    service = DecodeService(make_engine(num_slots=2), store)

    async def main():
        return await collect(service.decode("d1", transfer(store, story), GREEDY,
                                            resumed=[1] * (story.prompt_len + 1)))

    with pytest.raises(InvalidRequest) as refused:
        asyncio.run(main())
    assert refused.value.code == "invalid_kv_transfer_params"


def test_each_call_ends_decodes_turn_once_when_its_first_token_is_written_or_it_fails(make_engine, story, store,
                                                                                     tmp_path, monkeypatch):
    """Decode's turn (services/hostcpu/compute_lease.py): prefill's next forward waits until decode has sent on
    the first tokens handed to it.  A call counts once, right after its first event is taken (not at its end),
    and a call that fails before any token counts too, so a re-prefill does not wait for a turn never coming."""
    from services.hostcpu import compute_lease

    path = compute_lease.create(str(tmp_path / "lease"))
    follower = compute_lease.Follower(path)
    monkeypatch.setattr(compute_lease, "_FOLLOWER", [follower])

    def taken() -> int:
        return int.from_bytes(follower.board[compute_lease.TAKEN:compute_lease.TAKEN + 8], "little", signed=True)

    engine = make_engine(num_slots=2)
    service = DecodeService(engine, store)
    seen: list[int] = []

    async def note(_event) -> None:
        seen.append(taken())

    async def main():
        await collect(service.decode("d1", transfer(store, story), {**GREEDY, "max_tokens": 4}), note)
        params = transfer(store, story, key="req|d2|x")
        store.delete(params["handle"]["key"])
        with pytest.raises(NotFound):
            await collect(service.decode("d2", params, {**GREEDY, "max_tokens": 4}))

    asyncio.run(main())
    # while the first event is read it is not yet counted; from the second on it is; the failed call adds one
    assert seen[0] == 0 and set(seen[1:]) == {1} and taken() == 2
    assert all_back(engine)
