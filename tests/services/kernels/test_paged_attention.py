"""The paged decode attention kernel (services/kernels/paged_attention.c), every variant this CPU runs, against
torch on random pools at the shapes real checkpoints use: head_dim 64/80/128, GQA groups 1-8, blocks of 16 and
32 tokens, odd lengths, 1-64 rows, block tables in random order."""

from __future__ import annotations

import pytest
import torch

from services.decode.attention import CPagedAttention
from tests.support.kernel_variants import only_variant, runnable

VARIANTS = runnable("paged_attention")


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def reference(q, k_pool, v_pool, tables, lens, scale):
    """Each row alone: its blocks gathered in table order, the first len tokens, SDPA in float64."""
    rows, heads, dim = q.shape
    kv_heads, block = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for row in range(rows):
        n = int(lens[row])
        ids = tables[row, :(n + block - 1) // block].long()
        keys = k_pool[ids].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n].double()
        values = v_pool[ids].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n].double()
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        weights = torch.softmax((q[row].double()[:, None, :] @ keys.transpose(1, 2)) * scale, dim=-1)
        out[row] = (weights @ values)[:, 0]
    return out


def random_batch(rows: int, heads: int, kv_heads: int, dim: int, block: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 6 * block + 1, (rows,), generator=gen, dtype=torch.int32)
    lens[0] = 1                                      # a row of one token
    if rows > 1:
        lens[1] = 4 * block + 1                      # one token into a new block
    need = [(int(n) + block - 1) // block for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(rows, max(need) + 2, dtype=torch.int32)
    at = 0
    for row, count in enumerate(need):
        tables[row, :count] = order[at:at + count]
        at += count
    k_pool = torch.randn(num_blocks, kv_heads, block, dim, generator=gen)
    v_pool = torch.randn(num_blocks, kv_heads, block, dim, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    return q, k_pool, v_pool, tables, lens


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dim", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block", [16, 32])
def test_matches_torch_at_real_shapes(monkeypatch, variant, dim, group, block):
    kv_heads = 2 if group < 8 else 1
    with only_variant(monkeypatch, "paged_attention", variant):
        kernel = CPagedAttention()
        for rows, threads in ((1, 1), (7, 2), (64, 2)):
            q, k_pool, v_pool, tables, lens = random_batch(rows, kv_heads * group, kv_heads, dim, block, rows + dim)
            torch.set_num_threads(threads)
            got = kernel(q, k_pool, v_pool, tables, lens, dim ** -0.5)
            want = reference(q, k_pool, v_pool, tables, lens, dim ** -0.5)
            assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max(), (rows, threads)


def test_a_wrong_length_is_caught():
    """Negative control: the reference tells one token more or less apart."""
    q, k_pool, v_pool, tables, lens = random_batch(5, 8, 2, 64, 16, 0)
    got = CPagedAttention()(q, k_pool, v_pool, tables, lens + 1, 0.125)
    want = reference(q, k_pool, v_pool, tables, lens, 0.125)
    assert (got.double() - want).abs().max() > 1e-3
