"""DecodeEngine end to end on the tiny demo model: tokens equal Hugging Face `generate`."""

from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from services.generation.params import DecodeParams

GREEDY = {"temperature": 0.0, "ignore_eos": False}
PROMPTS = [
    "hi",
    "Tell me a long story about cats and dogs living together in a small house.",
    "What is 2+2?",
    "Translate to French: the weather is nice today, let us go for a walk in the park.",
    "List three colours.",
    "Write a haiku about the sea and the wind and the rain falling on the old harbour at night.",
]
MAX_TOKENS = [12, 30, 7, 25, 18, 40]


def test_staggered_greedy_matches_generate(tiny, make_engine, submit):
    prefilled = [tiny.prefill_text(tiny.chat_ids(p)) for p in PROMPTS]
    assert len({p.prompt_len for p in prefilled}) == len(PROMPTS)
    engine = make_engine(num_slots=4)
    sinks = {}
    for i in (0, 1):
        sinks[i] = submit(engine, f"r{i}", prefilled[i], max_tokens=MAX_TOKENS[i], **GREEDY)
    sinks[1].wait_tokens(5)                    # r2..r3 join while r0/r1 are mid-way
    for i in (2, 3):
        sinks[i] = submit(engine, f"r{i}", prefilled[i], max_tokens=MAX_TOKENS[i], **GREEDY)
    sinks[3].wait_tokens(3)
    for i in (4, 5):                           # all 4 slots may be busy: these wait, then join
        sinks[i] = submit(engine, f"r{i}", prefilled[i], max_tokens=MAX_TOKENS[i], **GREEDY)
    for i, pre in enumerate(prefilled):
        final = sinks[i].wait_done()
        expected = tiny.reference(pre, MAX_TOKENS[i])
        assert sinks[i].token_ids == expected, f"request {i}"
        assert final.completion_tokens == len(expected)
        assert final.finish_reason == ("length" if len(expected) == MAX_TOKENS[i] else "stop")
        text = "".join(e.text for e in sinks[i].events)
        assert text == tiny.tokenizer.decode(expected, skip_special_tokens=True)
    stats = engine.stats()
    assert (stats.active, stats.queued, stats.finished) == (0, 0, len(PROMPTS))


def test_image_prompt_uses_rope_delta(tiny, make_engine, submit):
    pixels = (np.random.RandomState(0).rand(56, 84, 3) * 255).astype("uint8")
    pre = tiny.prefill_image("Describe the picture.", Image.fromarray(pixels))
    assert pre.rope_delta != 0
    text_pre = tiny.prefill_text(tiny.chat_ids("Some text prompt of a similar length, to share the batch."))
    engine = make_engine(num_slots=2)
    image_sink = submit(engine, "img", pre, max_tokens=20, **GREEDY)
    text_sink = submit(engine, "txt", text_pre, max_tokens=14, **GREEDY)
    assert image_sink.wait_done() and text_sink.wait_done()
    assert image_sink.token_ids == tiny.reference(pre, 20)
    assert text_sink.token_ids == tiny.reference(text_pre, 14)


def test_stream_iteration_sync_and_async(tiny, make_engine):
    import asyncio

    pre = tiny.prefill_text(tiny.chat_ids("Count to five."))
    engine = make_engine(num_slots=2)
    expected = tiny.reference(pre, 9)
    params = DecodeParams(max_tokens=9, **GREEDY)
    stream = engine.submit("sync", pre.kv, pre.prompt_len, 0, pre.first_token, params)
    assert [t for e in stream for t in e.token_ids] == expected

    async def consume() -> list[int]:
        stream = engine.submit("async", pre.kv, pre.prompt_len, 0, pre.first_token,
                               DecodeParams(max_tokens=9, **GREEDY))
        return [t async for e in stream.events() for t in e.token_ids]

    assert asyncio.run(consume()) == expected


def test_seeded_sampling_is_independent_of_the_batch(tiny, make_engine, submit):
    pre = tiny.prefill_text(tiny.chat_ids("Write a short poem."))
    others = [tiny.prefill_text(tiny.chat_ids(p)) for p in PROMPTS[:3]]
    seeded = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "max_tokens": 24, "ignore_eos": True}

    def run(seed: int, neighbours: list) -> list[int]:
        engine = make_engine(num_slots=4)
        extra = [submit(engine, f"n{i}", p, max_tokens=10 + 5 * i, temperature=0.7 * i, ignore_eos=True)
                 for i, p in enumerate(neighbours)]
        sink = submit(engine, "seeded", pre, seed=seed, **seeded)
        for other in extra:
            other.wait_done()
        sink.wait_done()
        engine.close()
        return sink.token_ids

    alone = run(42, [])
    assert run(42, others) == alone
    assert run(42, others[:1]) == alone
    assert run(43, others) != alone


def test_throughput_16_streams_vs_1(tiny, make_engine, submit):
    """Printed figure; the project target is >= 8x, asserted >= 3x to stay robust on loaded CI cores."""
    pre = tiny.prefill_text(tiny.chat_ids("Tell me everything you know about the history of tea."))
    num_tokens = 48

    def tokens_per_s(num_streams: int) -> float:
        engine = make_engine(num_slots=num_streams)
        sinks = [submit(engine, f"t{num_streams}-{i}-{time.monotonic_ns()}", pre, max_tokens=num_tokens,
                         ignore_eos=True, temperature=0.0) for i in range(num_streams)]
        sinks[0].wait_tokens(2)
        start, before = time.perf_counter(), engine.stats().tokens
        for sink in sinks:
            sink.wait_done(60)
        elapsed = time.perf_counter() - start
        engine.close()
        return (engine.stats().tokens - before) / elapsed

    single = max(tokens_per_s(1) for _ in range(2))
    batched = max(tokens_per_s(16) for _ in range(2))
    ratio = batched / single
    print(f"\ndecode tokens/s: 1 stream {single:.0f}, 16 streams {batched:.0f}, ratio {ratio:.1f}x")
    assert batched >= 3 * single


@pytest.mark.parametrize("num_slots", [1])
def test_one_slot_serialises(tiny, make_engine, num_slots, submit):
    pre = [tiny.prefill_text(tiny.chat_ids(p)) for p in PROMPTS[:3]]
    engine = make_engine(num_slots=num_slots)
    sinks = [submit(engine, f"s{i}", p, max_tokens=6, **GREEDY) for i, p in enumerate(pre)]
    for sink, p in zip(sinks, pre, strict=True):
        sink.wait_done()
        assert sink.token_ids == tiny.reference(p, 6)


def test_a_new_requests_first_token_does_not_wait_for_the_running_step(tiny, make_engine):
    """`submit` emits the first token (prefill sampled it) on the caller's thread: a request that
    arrives while the worker thread is inside a step gets its first event at once, not after the step.
    Fake, named: every step is slowed to 0.6 s (the tiny model's steps take ~1 ms; a medium model's at
    16 rows ~80 ms, which every new request's TTFT used to wait for)."""
    import threading

    pre = tiny.prefill_text(tiny.chat_ids("Count to five."))
    engine = make_engine(num_slots=2)
    real_step, stepping = engine._runner.step, threading.Event()

    def slow_step(*args, **kwargs):
        stepping.set()
        time.sleep(0.6)
        return real_step(*args, **kwargs)

    engine._runner.step = slow_step
    running = engine.submit("running", pre.kv, pre.prompt_len, 0, pre.first_token,
                            DecodeParams(max_tokens=3, **GREEDY))
    assert stepping.wait(10)
    started = time.monotonic()
    stream = engine.submit("new", pre.kv, pre.prompt_len, 0, pre.first_token, DecodeParams(max_tokens=3, **GREEDY))
    first = stream.get(timeout=10)
    waited = time.monotonic() - started
    assert first.token_ids == [pre.first_token] and not first.finished
    assert waited < 0.3, f"the first token waited {waited:.3f} s (a step takes 0.6 s)"
    expected = tiny.reference(pre, 3)
    assert [first.token_ids[0], *(t for e in stream for t in e.token_ids)] == expected
    assert [t for e in running for t in e.token_ids] == expected
    stats = engine.stats()
    assert (stats.active, stats.queued, stats.finished, stats.tokens) == (0, 0, 2, 6)
