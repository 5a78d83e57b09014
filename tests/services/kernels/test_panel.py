"""The panel linears (services/kernels/panel.c, float32 and bfloat16 panels), every variant this CPU runs, against
F.linear at the shapes of real checkpoints' decode GEMMs (q/k/v/o, MLP, an LM head slice; hidden 896-2048) for
1-64 rows: each variant's tiles (6 rows on AVX2, up to 16 on AVX-512) give the same in-order sums, so every
variant's outputs are also equal to each other bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.models.panel_linear import PanelLinear
from tests.support.kernel_variants import only_variant, runnable

SHAPES = [(896, 896, True), (128, 896, True), (4864, 896, False), (896, 4864, False), (2048, 2048, False),
          (5632, 2048, False), (8195, 1024, False)]
ROWS = (1, 3, 6, 7, 16, 17, 33, 64)


def outputs(dtype: torch.dtype) -> dict[tuple[int, int, int], torch.Tensor]:
    out = {}
    for n, k, bias in SHAPES:
        torch.manual_seed(n + k)
        linear = nn.Linear(k, n, bias=bias)
        panel = PanelLinear(linear, dtype)
        reference = nn.Linear(k, n, bias=bias)
        reference.weight.copy_(linear.weight.to(dtype).float())
        if bias:
            reference.bias.copy_(linear.bias)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            got, want = panel(x), reference(x)
            assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, (n, k, rows)
            out[(n, k, rows)] = got
    return out


@pytest.mark.parametrize(("kernel", "dtype"), [("panel", torch.float32), ("panel_bf16", torch.bfloat16)])
@torch.inference_mode()
def test_every_variant_is_f_linear_and_the_same_bits(monkeypatch, kernel, dtype):
    results = {}
    for variant in runnable(kernel):
        with only_variant(monkeypatch, kernel, variant):
            results[variant] = outputs(dtype)
    first, *rest = results.values()
    for other in rest:
        assert all(torch.equal(first[key], other[key]) for key in first)
