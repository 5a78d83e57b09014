"""Prefill's AVX-512 causal attention (services/models/attention_kernel.py) against torch's SDPA: the rows of a chunk
with and without past tokens, grouped-query heads, the head sizes the families use, the strided views the packed
forward passes; spans it does not take go back to SDPA; and a mask off by one position is caught."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.kernels import loader
from services.models import attention_kernel

# Skipped only on a CPU without AVX-512; where it has it, a kernel that does not load fails (load() says why).
pytestmark = pytest.mark.skipif(not loader.expected("prefill_attention"), reason="no AVX-512: every span runs SDPA")


def test_the_kernel_loads_where_the_cpu_has_avx512():
    assert attention_kernel.load() == ""


def _case(rows: int, past: int, heads: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # the packed forward's layout: [1, T, H, D] projections seen as [H, T, D]
    q = (torch.randn(rows, heads, dim, generator=gen) * 2).transpose(0, 1)
    k = (torch.randn(past + rows, kv_heads, dim, generator=gen) * 2).transpose(0, 1)
    v = torch.randn(past + rows, kv_heads, dim, generator=gen).transpose(0, 1)
    return q, k, v


def _reference(q, k, v, past: int, scale: float | None = None) -> torch.Tensor:
    keys = torch.arange(k.shape[1])
    mask = keys[None, :] <= (torch.arange(q.shape[1]) + past)[:, None]
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out[0].transpose(0, 1)    # [n, Hq, D]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("rows", "past", "heads", "kv_heads", "dim"), [
    (1, 0, 2, 2, 16), (7, 0, 4, 2, 16), (117, 0, 16, 4, 64), (33, 300, 16, 4, 64), (9, 40, 8, 8, 128),
    (64, 0, 14, 2, 64), (200, 0, 2, 2, 32), (16, 1008, 4, 1, 80)])
def test_the_kernel_matches_sdpa(rows, past, heads, kv_heads, dim):
    q, k, v = _case(rows, past, heads, kv_heads, dim, seed=rows + past)
    out = torch.full((rows, heads, dim), float("nan"))
    assert attention_kernel.run(q, k, v, out, past, None)
    want = _reference(q, k, v, past)
    assert _rel(out, want) <= 2e-6
    # the scale the caller gives is the one used
    assert attention_kernel.run(q, k, v, out, past, 0.3)
    assert _rel(out, _reference(q, k, v, past, 0.3)) <= 2e-6


@pytest.mark.parametrize("dim", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_real_checkpoint_shapes_match_sdpa(dim, group):
    """head_dim 64/80/128, 1-8 query heads per KV head, odd chunk lengths with and without a past."""
    for rows, past in ((1, 0), (37, 0), (13, 251), (1, 999)):
        q, k, v = _case(rows, past, 8, 8 // group, dim, seed=rows + dim + group)
        out = torch.full((rows, 8, dim), float("nan"))
        assert attention_kernel.run(q, k, v, out, past, None)
        want = _reference(q.double(), k.double(), v.double(), past)   # float64: the kernel's own rounding is measured
        assert _rel(out.double(), want) <= 4e-6, (rows, past)


def test_a_mask_off_by_one_is_caught():
    """Negative control: the same comparison fails for attention that lets each row see one key too many."""
    q, k, v = _case(40, 10, 4, 2, 64, seed=5)
    out = torch.empty(40, 4, 64)
    assert attention_kernel.run(q, k, v, out, 10, None)
    shifted = _reference(q, k, v, 11)[:, :, :]   # row i sees keys 0 .. 11 + i
    assert _rel(out, shifted) > 1e-3


def test_spans_the_kernel_does_not_take_go_to_sdpa():
    q, k, v = _case(8, attention_kernel.MAX_KEYS - 4, 4, 2, 64, seed=1)
    out = torch.zeros(8, 4, 64)
    assert not attention_kernel.run(q, k, v, out, attention_kernel.MAX_KEYS - 4, None)   # past the kernel's span
    assert not out.any()                                                          # nothing written
    q, k, v = _case(8, 0, 4, 2, 24, seed=2)
    assert not attention_kernel.run(q, k, v, torch.zeros(8, 4, 24), 0, None)          # head size not a multiple of 16
    q, k, v = _case(8, 0, 4, 2, 64, seed=3)
    assert not attention_kernel.run(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16),
                                 torch.zeros(8, 4, 64, dtype=torch.bfloat16), 0, None)
    with pytest.raises(ValueError, match="attention over 20 keys given 4 keys / 8 values"):
        attention_kernel.run(q, k[:, :4], v, torch.zeros(8, 4, 64), 12, None)

