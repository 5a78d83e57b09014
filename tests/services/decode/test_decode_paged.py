"""Paged decode: block accounting, one copy in, pool-full admission, both attention kernels exact,
and negative controls (a wrong rope position or a wrong mask must be caught)."""

from __future__ import annotations

import pytest
import torch

from services.decode.attention import TorchPagedAttention
from services.decode.block_pool import BlockPool
from services.decode.errors import EngineFull
from services.decode.paged_forward import PagedDecoder
from tests.services.decode.conftest import GREEDY, hf_first_step_logits


def _kv_bytes(pre) -> int:
    return pre.kv.numel() * pre.kv.element_size()


def test_blocks_follow_tokens_and_all_return(make_engine, prefilled, submit):
    engine = make_engine(num_slots=4, block_size=16)
    sinks = [submit(engine, f"b{i}", p, max_tokens=40, ignore_eos=True, **GREEDY) for i, p in enumerate(prefilled)]
    sinks[0].wait_tokens(20)
    stats = engine.stats()
    # tokens held -> blocks: each request holds ceil(tokens / 16) blocks, never more
    assert stats.kv.used_blocks <= sum(-(-(p.prompt_len + 40) // 16) for p in prefilled)
    assert stats.kv.bytes_held == stats.kv.used_blocks * stats.kv.block_bytes
    assert stats.kv.tokens_held >= sum(p.prompt_len for p in prefilled)
    assert 1.0 <= stats.kv.held_ratio <= 1 + 16 * len(prefilled) / stats.kv.tokens_held
    for sink in sinks:
        sink.wait_done()
    stats = engine.stats()
    assert (stats.kv.used_blocks, stats.kv.reserved_blocks, stats.kv.tokens_held) == (0, 0, 0)
    assert stats.kv_bytes_copied == sum(_kv_bytes(p) for p in prefilled)       # one copy per request


def test_a_full_pool_refuses_then_takes_the_request_once_room_returns(tiny, make_engine, prefilled, submit):
    pre = prefilled[1]
    per_request = -(-(pre.prompt_len + 30 - 1) // 16)
    engine = make_engine(num_slots=4, block_size=16, kv_cache_bytes=per_request * engine_block_bytes(tiny))
    first = submit(engine, "first", pre, max_tokens=30, ignore_eos=True, **GREEDY)
    assert engine.reserve(pre.prompt_len, None) is None      # the pool promised all its blocks
    with pytest.raises(EngineFull, match="KV pool is full") as err:
        submit(engine, "second", pre, max_tokens=30, ignore_eos=True, **GREEDY)
    assert err.value.status == 429
    assert engine.stats().kv.reserved_blocks + engine.stats().kv.used_blocks == per_request  # nothing leaked
    first.wait_done()
    second = submit(engine, "second", pre, max_tokens=30, ignore_eos=True, **GREEDY).wait_done()
    assert second.completion_tokens == 30


def engine_block_bytes(tiny) -> int:
    from services.decode.block_pool import block_bytes

    return block_bytes(tiny.lm.layout, 16)


def test_the_eager_steps_attention_gives_generate_tokens(tiny, make_engine, prefilled, submit):
    engine = make_engine(num_slots=4, block_size=8, fused="off")
    assert engine.stats().attention_kernel == "torch" and engine.stats().step_mode == "eager"
    sinks = [submit(engine, f"k{i}", p, max_tokens=24, **GREEDY) for i, p in enumerate(prefilled)]
    for sink, pre in zip(sinks, prefilled, strict=True):
        sink.wait_done()
        assert sink.token_ids == tiny.reference(pre, 24)


class _DropNewest:
    """A masking bug on purpose: each row attends to all but its newest token."""

    name = "drop-newest"

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, q, keys, values, tables, lens, scale, num_blocks=None):
        return self.inner(q, keys, values, tables, lens - 1, scale, num_blocks)


@torch.inference_mode()
def _first_step_logits(tiny, pre, attention, position_shift: int = 0) -> torch.Tensor:
    """Logits of the first decode step through the paged forward (batch of one)."""
    lm = tiny.lm
    pool = BlockPool(lm.layout, 64 * 1024 * 1024 // 8, block_size=16)
    decoder = PagedDecoder(lm, pool, attention)
    from services.decode.request_blocks import RequestBlocks

    assert pool.try_reserve(pool.blocks_for(pre.prompt_len + 1))
    blocks = RequestBlocks(pool, pool.blocks_for(pre.prompt_len + 1))
    blocks.load(pre.kv)
    position = blocks.num_tokens
    block, offset, _ = blocks.append_slot()
    tables = torch.tensor([blocks.blocks], dtype=torch.int32)
    shifted = torch.tensor([position + pre.rope_delta + position_shift])
    logits = decoder.forward(torch.tensor([pre.first_token]), shifted, torch.tensor([block]), torch.tensor([offset]),
                             tables, torch.tensor([blocks.num_tokens], dtype=torch.int32))
    blocks.release()
    return logits[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_logits_match_hf_within_1e4_and_the_negative_controls_are_caught(tiny, prefilled):
    kernels = [TorchPagedAttention()]
    for pre in prefilled:
        want = hf_first_step_logits(tiny, pre)
        for kernel in kernels:
            assert _rel(_first_step_logits(tiny, pre, kernel), want) <= 1e-4, kernel.name
        # controls: an off-by-one rope position and a mask that hides the newest token both fail the check
        assert _rel(_first_step_logits(tiny, pre, kernels[-1], position_shift=1), want) > 1e-3
        assert _rel(_first_step_logits(tiny, pre, _DropNewest(kernels[-1])), want) > 1e-3


def test_the_engine_comparison_catches_a_wrong_rope_position(tiny, make_engine, prefilled, submit):
    pre = prefilled[1]
    shifted = type(pre)(pre.kv, pre.prompt_len, pre.rope_delta + 1, pre.first_token, pre.inputs)
    engine = make_engine(num_slots=2)
    sink = submit(engine, "shifted", shifted, max_tokens=16, ignore_eos=True, **GREEDY)
    sink.wait_done()
    assert sink.token_ids != tiny.reference(pre, 16)


def test_steps_of_serial_rows_run_on_one_thread_and_the_rest_on_all(tiny, make_engine, prefilled, submit):
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)       # the policy needs a second thread to give up
    seen: list[tuple[int, int]] = []   # (rows in the step, torch threads while its LM head ran)
    hook = tiny.lm.lm_head.register_forward_hook(
        lambda module, args, out: seen.append((args[0].shape[0], torch.get_num_threads())))
    try:
        engine = make_engine(num_slots=4, serial_rows=1, lm_head_screen="off")   # every step through the hooked head
        alone = submit(engine, "alone", prefilled[1], max_tokens=6, ignore_eos=True, **GREEDY).wait_done()
        both = [submit(engine, f"pair{i}", prefilled[i], max_tokens=12, ignore_eos=True, **GREEDY) for i in (0, 2)]
        for sink in both:
            sink.wait_done()
    finally:
        hook.remove()
    assert alone.completion_tokens == 6
    one_row = [threads for rows, threads in seen if rows == 1]
    more = [threads for rows, threads in seen if rows > 1]
    assert one_row and set(one_row) == {1}
    assert more and set(more) == {engine._runner.threads} and engine._runner.threads >= 2
    stats = engine.stats()
    assert stats.serial_steps == len(one_row) and stats.steps == len(seen)
    assert "steps of <= 1 rows on 1" in engine.describe()


def test_auto_serial_rows_is_four_rows_on_two_cores_and_one_row_beyond(monkeypatch):
    import os

    from services.decode.app import serial_rows

    assert serial_rows(0, 16) == 0 and serial_rows(3, 16) == 3        # set values are kept
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # what this project's CI machine has
    assert serial_rows(-1, 16) == 4 and serial_rows(-1, 2) == 2
    assert serial_rows(-1, 16, fused=True) == 0 and serial_rows(2, 16, fused=True) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert serial_rows(-1, 16) == 1 and serial_rows(-1, 16, fused=True) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_kv_lands_in_its_blocks_exactly_whatever_the_block_ids(tiny, dtype):
    """`RequestBlocks.load`: every token's K/V at (its block, its offset), widened exactly from bfloat16, with the
    pool's ids consecutive (slice copies), in a few runs, and scattered (one indexed copy); one copy counted."""
    from services.decode.request_blocks import RequestBlocks, _runs

    layout = tiny.lm.layout
    pool = BlockPool(layout, 8 << 20, block_size=4)
    gen = torch.Generator().manual_seed(3)
    assert _runs([5, 6, 7, 2, 3, 9]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)] and _runs([]) == []
    # scatter the free list: every other block is held by a filler, so the next load gets runs of length one
    fillers = []
    for _ in range(24):
        assert pool.try_reserve(1)
        fillers.append(RequestBlocks(pool, 1))
        fillers[-1].load(torch.zeros(layout.num_layers, 2, layout.num_kv_heads, 1, layout.head_dim))
    for filler in fillers[::2]:
        filler.release()
    for tokens in (18, 41, 7):
        kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim, generator=gen).to(dtype)
        assert pool.try_reserve(pool.blocks_for(tokens))
        blocks = RequestBlocks(pool, pool.blocks_for(tokens))
        blocks.load(kv)
        assert blocks.bytes_copied == kv.numel() * kv.element_size()
        for token in range(tokens):
            block, offset = blocks.blocks[token // 4], token % 4
            assert torch.equal(pool.kv[:, :, block, :, offset], kv[:, :, :, token].float())
        blocks.release()
