"""PrefillService over real shm stores: the prefilled KV reaches the KV store with exactly one copy
(from the engine's blocks into the store's memory), concurrent requests batch, and every block
comes back, also when a caller gives up."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import torch

from services.connectors import StoreConfig, create_store
from services.prefill.engine import PrefillEngine
from services.prefill.serving import PrefillService

PROMPTS = [[151644, 872, 198, *range(1000 + 40 * i, 1000 + 40 * i + 30 + 7 * i), 151645, 198] for i in range(5)]


@pytest.fixture(scope="module")
def lm(demo_model_path):
    from services.models.registry import adapter_for

    return adapter_for(demo_model_path).load_language(demo_model_path)


@pytest.fixture
def stores():
    instance = "t" + uuid.uuid4().hex[:12]
    ec = create_store(StoreConfig("shm", "ec", instance, capacity_bytes=1 << 20))
    kv = create_store(StoreConfig("shm", "kv", instance, capacity_bytes=16 << 20))
    yield ec, kv
    kv.close()
    ec.close()


def kv_bytes(lm, num_tokens: int) -> int:
    layout = lm.layout
    return layout.num_layers * 2 * layout.num_kv_heads * num_tokens * layout.head_dim * 4


def test_the_kv_is_copied_once_into_the_store(lm, stores):
    ec, kv = stores
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    service = PrefillService(engine, lm, ec, kv, "p0")
    before = kv.stats().bytes_copied
    outcome = asyncio.run(service.prefill("r1", PROMPTS[0], [], {}, {"temperature": 0.0}, None))
    assert kv.stats().bytes_copied - before == kv_bytes(lm, len(PROMPTS[0]))  # one copy, nothing more
    with kv.view(outcome.kv_transfer_params["handle"]) as views:
        torch.testing.assert_close(views["kv"], engine.prefill(PROMPTS[0]).kv, rtol=0, atol=0)
    assert outcome.first_token_id == int(engine.prefill(PROMPTS[0]).first_logits.argmax())
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_concurrent_requests_share_forwards_and_return_their_blocks(lm, stores, monkeypatch):
    from services import compute_threads

    monkeypatch.setattr(compute_threads, "INLINE_FORWARD_FLOPS", 0.0)   # every forward on the engine's worker
    ec, kv = stores
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    service = PrefillService(engine, lm, ec, kv, "p0")

    async def main() -> list:
        with engine._cond:  # every request reaches the engine before its first forward
            tasks = [asyncio.create_task(service.prefill(f"r{i}", ids, [], {}, {}, None))
                     for i, ids in enumerate(PROMPTS)]
            await asyncio.sleep(0.2)
        return await asyncio.gather(*tasks)

    outcomes = asyncio.run(main())
    assert engine.recent_batches[0] == (len(PROMPTS), sum(len(ids) for ids in PROMPTS))
    for outcome, ids in zip(outcomes, PROMPTS, strict=True):
        with kv.view(outcome.kv_transfer_params["handle"]) as views:
            torch.testing.assert_close(views["kv"], engine.prefill(ids).kv, rtol=0, atol=1e-5)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_caller_that_gives_up_leaves_no_blocks_held(lm, stores, monkeypatch):
    from services import compute_threads

    monkeypatch.setattr(compute_threads, "INLINE_FORWARD_FLOPS", 0.0)   # every forward on the engine's worker
    ec, kv = stores
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    service = PrefillService(engine, lm, ec, kv, "p0")

    async def main() -> None:
        with engine._cond:  # the request is queued, then cancelled while the engine is held
            task = asyncio.create_task(service.prefill("r1", PROMPTS[1], [], {}, {}, None))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while engine.num_waiting:  # the worker drops the cancelled prompt when it looks
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.num_prefills == 0  # cancelled before its forward
    assert engine.blocks.num_free == engine.blocks.num_blocks and kv.stats().entries == 0


@pytest.mark.parametrize("local", [True, False])
def test_the_kv_is_put_on_the_engine_thread_right_after_the_forward(lm, stores, local):
    """No thread hand-off between the forward and the put: the thread that ran the forward (the engine's, or the
    idle engine's caller: here the loop) copies the blocks into a local store and gives them back before the
    caller's loop hears of the prompt.  A store that does I/O (Redis) is written from a worker thread instead,
    so the engine's next forward never waits on the network."""
    ec, kv = stores
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    threads: list[str] = []
    put_into, forward = kv.put_into, engine._forward
    forwards: list[str] = []
    engine._forward = lambda batch: (forwards.append(threading.current_thread().name), forward(batch))[1]

    def noting(key, specs, fill):
        threads.append(threading.current_thread().name)
        return put_into(key, specs, fill)

    kv.put_into = noting
    kv.local = local
    service = PrefillService(engine, lm, ec, kv, "p0")
    outcome = asyncio.run(service.prefill("r1", PROMPTS[0], [], {}, {}, None))
    assert len(threads) == len(forwards) == 1 and (threads == forwards) is local
    handle = outcome.kv_transfer_params["handle"]
    assert handle["key"].startswith("req|r1|") and kv.lookup(handle["key"]) is not None
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_caller_that_gives_up_during_the_forward_leaves_no_entry(lm, stores, monkeypatch):
    """The prompt's forward finishes and its KV is put after the caller left: the entry nobody will read is
    deleted and every block comes back.  (The forward is held on purpose: a named fake for the timing.)"""
    from services import compute_threads

    monkeypatch.setattr(compute_threads, "INLINE_FORWARD_FLOPS", 0.0)   # on the worker: the caller can leave
    ec, kv = stores
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    service = PrefillService(engine, lm, ec, kv, "p0")
    entered, release = threading.Event(), threading.Event()
    forward = engine._forward

    def held_forward(batch):
        entered.set()
        assert release.wait(30)
        forward(batch)

    engine._forward = held_forward

    async def main() -> None:
        task = asyncio.create_task(service.prefill("r1", PROMPTS[1], [], {}, {}, None))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while engine.num_waiting or kv.stats().entries or engine.blocks.num_free != engine.blocks.num_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.num_prefills == 1 and kv.stats().puts == 1  # it ran and was put, then dropped


def test_an_idle_engine_prefills_a_small_prompt_on_the_loop(lm, stores):
    """No hand-off to the engine thread and back: the loop runs the forward and the KV put; the same KV."""
    ec, kv = stores
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    service = PrefillService(engine, lm, ec, kv, "p0")
    threads: list[str] = []
    forward = engine._forward
    engine._forward = lambda batch: (threads.append(threading.current_thread().name), forward(batch))[1]

    async def main():
        outcome = await service.prefill("r-inline", PROMPTS[1], [], {}, {}, None)
        return outcome, threading.current_thread().name

    outcome, loop_thread = asyncio.run(main())
    assert threads == [loop_thread] and engine._worker is None
    with kv.view(outcome.kv_transfer_params["handle"]) as views:
        torch.testing.assert_close(views["kv"], engine.prefill(PROMPTS[1]).kv, rtol=0, atol=0)
    assert engine.blocks.num_free == engine.blocks.num_blocks
