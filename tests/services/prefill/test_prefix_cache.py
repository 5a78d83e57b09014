"""Prefix cache: hits only for the same salt, tokens and images; outputs identical with or without hits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.prefill.engine import PrefillEngine
from services.prefill.kv_pool import block_bytes
from services.prefill.prefix_cache import BLOCK_SIZE, block_hashes
from tests.services.models.helpers import (
    chat,
    encode_items,
    greedy_continue,
    mm_inputs,
    picture,
    processor_inputs,
)

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def parts(demo_model_path):
    from services.models.processing import load_processor
    from services.models.registry import adapter_for

    adapter = adapter_for(demo_model_path)
    return (load_processor(demo_model_path), adapter.load_vision(demo_model_path),
            adapter.load_language(demo_model_path))


def prompt(parts, seed: int, text: str = "Describe what you see.", mm_hash: str | None = "auto"):
    """(token_ids, items) of a one-image chat; the mm_hash names the picture unless given."""
    processor, vision, _ = parts
    inputs = processor_inputs(processor, chat(picture(448, 280, seed), text=text))
    token_ids = inputs["input_ids"][0].tolist()
    items = encode_items(inputs)
    mm = mm_inputs(token_ids, items, vision.encode(items))
    return token_ids, [dataclasses.replace(item, mm_hash=f"picture-{seed}" if mm_hash == "auto" else mm_hash)
                       for item in mm]


def run(engine: PrefillEngine, lm, token_ids, items, salt=None):
    result = engine.prefill(token_ids, items, cache_salt=salt)
    return result, greedy_continue(lm, result, NEW_TOKENS)


def test_repeat_prompt_hits_and_matches(parts):
    lm = parts[2]
    token_ids, items = prompt(parts, seed=1)
    plain, plain_tokens = run(PrefillEngine(lm, prefix_cache_mb=0), lm, token_ids, items)
    engine = PrefillEngine(lm, prefix_cache_mb=16)
    first, _ = run(engine, lm, token_ids, items)
    second, second_tokens = run(engine, lm, token_ids, items)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.num_cached_tokens > items[0].offset + items[0].length  # the image's blocks hit too
    assert second_tokens == plain_tokens and second.rope_delta == plain.rope_delta
    torch.testing.assert_close(second.kv, plain.kv, rtol=0, atol=1e-5)
    torch.testing.assert_close(second.first_logits, plain.first_logits, rtol=0, atol=1e-4)


def test_other_salt_never_hits(parts):
    lm = parts[2]
    token_ids, items = prompt(parts, seed=1)
    engine = PrefillEngine(lm, prefix_cache_mb=16)
    engine.prefill(token_ids, items, cache_salt="tenant-a")
    assert engine.prefill(token_ids, items, cache_salt="tenant-b").num_cached_tokens == 0
    assert engine.prefill(token_ids, items, cache_salt="tenant-a").num_cached_tokens > 0


def test_other_image_reuses_only_blocks_before_it(parts):
    lm = parts[2]
    token_ids, items_a = prompt(parts, seed=1)
    same_tokens, items_b = prompt(parts, seed=2)
    assert same_tokens == token_ids  # same size: only the image differs
    engine = PrefillEngine(lm, prefix_cache_mb=16)
    engine.prefill(token_ids, items_a)
    hit, hit_tokens = run(engine, lm, token_ids, items_b)
    plain, plain_tokens = run(PrefillEngine(lm, prefix_cache_mb=0), lm, token_ids, items_b)
    assert hit.num_cached_tokens == items_b[0].offset // BLOCK_SIZE * BLOCK_SIZE
    assert hit_tokens == plain_tokens


def test_shared_text_prefix(parts):
    lm = parts[2]
    engine = PrefillEngine(lm, prefix_cache_mb=16)
    first_ids, first_items = prompt(parts, seed=3, text="Describe what you see.")
    other_ids, other_items = prompt(parts, seed=3, text="Count the colours, then name each one slowly.")
    engine.prefill(first_ids, first_items)
    hit, hit_tokens = run(engine, lm, other_ids, other_items)
    _, plain_tokens = run(PrefillEngine(lm, prefix_cache_mb=0), lm, other_ids, other_items)
    common = next(i for i, (a, b) in enumerate(zip(first_ids, other_ids, strict=False)) if a != b)
    assert hit.num_cached_tokens == common // BLOCK_SIZE * BLOCK_SIZE > 0
    assert hit_tokens == plain_tokens


def test_unhashed_item_stops_the_chain(parts):
    token_ids, items = prompt(parts, seed=1, mm_hash=None)
    keys = block_hashes(token_ids, items, None)
    assert len(keys) == items[0].offset // BLOCK_SIZE  # only the blocks wholly before the image
    engine = PrefillEngine(parts[2], prefix_cache_mb=16)
    engine.prefill(token_ids, items)
    assert engine.prefill(token_ids, items).num_cached_tokens == len(keys) * BLOCK_SIZE


def test_lru_bound(parts):
    lm = parts[2]
    four_blocks = 4 * block_bytes(lm.layout, BLOCK_SIZE) / 2**20
    engine = PrefillEngine(lm, prefix_cache_mb=four_blocks)
    token_ids, items = prompt(parts, seed=1)
    engine.prefill(token_ids, items)
    assert engine.blocks.num_cached == 4  # only the 4 most recently used blocks are kept
    assert engine.prefill(token_ids, items).num_cached_tokens == 0  # the first blocks were evicted


def test_a_hit_shares_the_first_prompts_blocks(parts):
    token_ids, items = prompt(parts, seed=1)
    engine = PrefillEngine(parts[2], prefix_cache_mb=16)
    with engine.submit(token_ids, items).result(60) as first:
        first_blocks = first.blocks
    shared = (len(token_ids) - 1) // BLOCK_SIZE
    assert engine.blocks.num_cached == len(token_ids) // BLOCK_SIZE  # its own full blocks, kept as they are
    with engine.submit(token_ids, items).result(60) as second, engine.submit(token_ids, items).result(60) as third:
        assert second.num_cached_tokens == third.num_cached_tokens == shared * BLOCK_SIZE
        assert second.blocks[:shared] == third.blocks[:shared] == first_blocks[:shared]  # the same blocks
        assert [engine.blocks.refs(b) for b in first_blocks[:shared]] == [2] * shared
        assert second.blocks[shared:] != third.blocks[shared:]  # the rest is each prompt's own
        torch.testing.assert_close(second.kv(), third.kv(), rtol=0, atol=0)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_fill_writes_the_kv_once_into_the_given_memory(parts):
    token_ids, items = prompt(parts, seed=1)
    engine = PrefillEngine(parts[2], prefix_cache_mb=0)
    held = engine.submit(token_ids, items).result(60)
    [(dtype, shape, _)] = held.kv_spec().values()
    assert dtype == torch.float32 and shape[3] == len(token_ids)
    memory = torch.zeros((2, *shape), dtype=dtype)
    held.fill({"kv": memory[1]})
    torch.testing.assert_close(memory[1], engine.prefill(token_ids, items).kv, rtol=0, atol=1e-5)
    assert not memory[0].any()
    held.release()
    with pytest.raises(RuntimeError, match="released"):
        held.fill({"kv": memory[1]})
