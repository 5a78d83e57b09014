"""The GPU budget's arithmetic with exact figures (services/decode/gpu_budget.py); no GPU needed."""

from __future__ import annotations

import pytest

from services.config import EpdConfig
from services.decode.gpu_budget import (
    FIXED_WORKSPACE,
    INT32_ELEMENTS,
    MIB,
    decode_pool_bytes,
    ipc_reserve,
    pool_blocks,
    step_workspace,
)
from services.runtime.launch import Child, start_order

GIB = 1 << 30


def test_decode_gets_what_the_fraction_leaves_after_everything_on_the_gpu_and_the_reserve():
    # 80 GiB card, 0.9 of it for epd; 20 GiB already used (weights of every role, prefill's pool, contexts)
    budget = decode_pool_bytes(80 * GIB, 60 * GIB, 0.9, 2 * GIB, min_pool=MIB)
    assert budget.pool == int(0.9 * 80 * GIB) - 20 * GIB - 2 * GIB == 50 * GIB
    assert budget.used == 20 * GIB
    assert budget.line() == ("GPU budget 0.9 x 80.0 GiB: 20.00 GiB in use on the device, 2.00 GiB reserved, "
                             "KV pool 50.00 GiB")


def test_a_budget_too_small_for_one_request_is_refused_with_its_figures():
    with pytest.raises(ValueError, match="KV pool 0.00 GiB: too small for one request of max_model_len"):
        decode_pool_bytes(80 * GIB, 5 * GIB, 0.9, GIB, min_pool=MIB)
    with pytest.raises(ValueError, match=r"gpu_memory_fraction must be in \(0, 1\]"):
        decode_pool_bytes(80 * GIB, 60 * GIB, 0.0, 0, min_pool=1)
    with pytest.raises(ValueError, match="reports 90 bytes free of 80"):
        decode_pool_bytes(80, 90, 0.5, 0, min_pool=1)


def test_the_step_workspace_counts_logits_activations_mask_and_a_fixed_part():
    # 64 rows of a 1024-hidden, 2816-intermediate, 151936-vocab bfloat16 model over 1000 pool blocks
    logits = 64 * 151936 * 2 + 64 * 8
    activations = 64 * (8 * 1024 + 3 * 2816) * 2
    assert step_workspace(64, 1024, 2816, 151936, 2, 1000) == logits + 2 * activations + 8 * 1002 + FIXED_WORKSPACE


def test_pool_blocks_keep_flex_offsets_in_32_bits_and_round_to_five_bits():
    # a real model's pool: 28 layers x 2 x 2 heads x 16 tokens x 128 x 2 bytes per block; 50 GiB
    block = 28 * 2 * 2 * 16 * 128 * 2
    raw = 50 * GIB // block                                   # 117,028 blocks = 0b11100100100100100
    assert pool_blocks(50 * GIB, block, 16, 2, 128) == 0b11100 << 12 == 114688   # within 1/16 below
    assert pool_blocks(50 * GIB + 3 * block, block, 16, 2, 128) == 114688        # small jitter: the same pool
    assert 114688 <= raw < 114688 * 17 // 16
    # a tiny model (2 heads of 16): 40 GiB would be 2.6 G elements per head; capped under 2^31
    capped = pool_blocks(40 * GIB, 2 * 2 * 2 * 16 * 16 * 2, 16, 2, 16)
    assert (capped + 1) * 16 * 2 * 16 <= INT32_ELEMENTS and capped == 0b11111 << 17
    assert pool_blocks(100, 4096, 16, 2, 16) == 0


def test_ipc_reserve_counts_only_the_shm_connectors_stores():
    assert ipc_reserve("shm", "shm", 256, 512) == 768 * MIB
    assert ipc_reserve("redis", "shm", 256, 512) == 512 * MIB
    assert ipc_reserve("redis", "redis", 256, 512) == 0


def test_epd_serve_starts_decode_last_on_cuda_and_everything_at_once_on_cpu():
    roles = [Child(role, f"i_{role}", 1, 2) for role in ("render", "encode", "prefill", "decode", "decode")]
    assert start_order(EpdConfig(), roles) == [roles]
    first, last = start_order(EpdConfig.of(device="cuda"), roles)
    assert [c.role for c in first] == ["render", "encode", "prefill"] and [c.role for c in last] == ["decode"] * 2
