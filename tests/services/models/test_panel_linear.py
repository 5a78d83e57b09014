"""The panel kernel (services/models/panel_linear.py): F.linear's outputs for every shape and batch a model
gives, on torch's own OpenMP runtime, refusing what it cannot take."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.models import panel_linear
from services.models.panel_linear import PanelLinear, panelize


def test_the_kernel_builds_on_this_machine():
    assert panel_linear.available(), panel_linear.unavailable_reason()


@pytest.mark.parametrize("out_features, in_features, bias", [
    (49152, 576, False),     # SmolLM2's LM head
    (192, 576, False),       # a k projection (12 panels: fewer than 4 per thread)
    (17, 13, True),          # neither a whole panel nor a whole vector
    (1, 8, True),            # one output
    (33, 1030, True),        # K past two 512-float strides, odd tail
])
@torch.inference_mode()
def test_outputs_match_f_linear_for_every_batch_size(out_features, in_features, bias):
    torch.manual_seed(out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    panel = PanelLinear(linear)
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 40):
        x = torch.randn(rows, in_features)
        want, got = linear(x), panel(x)
        assert got.shape == want.shape
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, rows


@pytest.mark.parametrize("in_features", [256, 1024, 1040])
@torch.inference_mode()
def test_every_tile_split_gives_the_same_bits(in_features):
    """Rows 9-33 run as tiles of up to 16 rows (copied 64 bytes apart first when their stride is a multiple of
    1 KiB, 256 and 1024 here); each output is the same in-order sum whichever tile holds its row, so a batch
    equals its rows computed one by one, bit for bit, and a strided view equals its contiguous copy."""
    torch.manual_seed(in_features)
    panel = PanelLinear(nn.Linear(in_features, 70, bias=True))
    for rows in (9, 12, 15, 16, 17, 28, 33):
        x = torch.randn(rows, in_features)
        alone = torch.cat([panel(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(panel(x), alone), rows
        strided = torch.randn(rows, in_features + 256)[:, :in_features]
        assert torch.equal(panel(strided), panel(strided.contiguous())), rows


@torch.inference_mode()
def test_leading_dimensions_strides_and_empty_batches():
    linear = nn.Linear(64, 40)
    panel = PanelLinear(linear)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(panel(x), linear(x), rtol=1e-5, atol=1e-5)
    wide = torch.randn(5, 128)[:, ::2]                       # a non-unit column stride
    assert torch.allclose(panel(wide), linear(wide), rtol=1e-5, atol=1e-5)
    rows = torch.randn(8, 96)[:, :64]                        # a row stride wider than K
    assert torch.allclose(panel(rows), linear(rows), rtol=1e-5, atol=1e-5)
    assert panel(torch.randn(0, 64)).shape == (0, 40)


def test_panels_hold_the_weight_interleaved_and_zero_padded():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = panelize(weight)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0, 2, :], weight[:16, 2]) and torch.equal(panels[1, 1, :4], weight[16:, 1])
    assert torch.count_nonzero(panels[1, :, 4:]) == 0


def test_other_dtypes_are_refused_clearly():
    panel = PanelLinear(nn.Linear(8, 8))
    with pytest.raises(TypeError, match="PanelLinear takes float32 CPU input, got torch.float64"):
        panel(torch.randn(2, 8, dtype=torch.float64))


def test_it_shares_torchs_openmp_runtime_and_threads():
    PanelLinear(nn.Linear(8, 8))(torch.randn(1, 8))
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) == 1 and "torch" in next(iter(gomps))     # one thread pool, torch's
    linear = nn.Linear(576, 4096)
    panel = PanelLinear(linear)
    x = torch.randn(3, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)                                 # the kernel follows torch's thread count
        one = panel(x)
    finally:
        torch.set_num_threads(before)
    with torch.inference_mode():
        assert torch.equal(one, panel(x))                        # each output's sum runs in one order


@pytest.mark.parametrize("out_features, in_features, bias", [(49152, 576, False), (17, 13, True), (33, 1030, True)])
@torch.inference_mode()
def test_bfloat16_panels_are_f_linear_over_the_rounded_weights(out_features, in_features, bias):
    """bfloat16 panels (decode's --dtype bfloat16): half the bytes, float32 arithmetic over the weights
    rounded to bfloat16 -- so F.linear over those rounded weights to 1e-5, and visibly not the float32 layer
    (the negative control: the rounding really happened)."""
    assert panel_linear.available(torch.bfloat16), panel_linear.unavailable_reason()
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    panel = PanelLinear(linear, torch.bfloat16)
    full = PanelLinear(linear).weight
    assert panel.weight.dtype == torch.bfloat16 and panel.weight.shape == full.shape
    assert panel.weight.numel() * panel.weight.element_size() * 2 == full.numel() * full.element_size()
    rounded = nn.Linear(in_features, out_features, bias=bias)
    rounded.weight.copy_(linear.weight.to(torch.bfloat16).float())
    if bias:
        rounded.bias.copy_(linear.bias)
    for rows in (1, 2, 5, 6, 7, 16):
        x = torch.randn(rows, in_features)
        got = panel(x)
        assert got.dtype == torch.float32
        assert float((got - rounded(x)).abs().max() / rounded(x).abs().max()) <= 1e-5, rows
        off = float((got - linear(x)).abs().max() / linear(x).abs().max())
        assert 1e-5 < off <= 1e-2, rows


def test_bfloat16_panels_are_the_rounded_weights_interleaved_and_other_dtypes_refused():
    weight = torch.randn(20, 3)
    panel = PanelLinear(nn.Linear(3, 20, bias=False), torch.bfloat16)
    panel_w = panelize(weight.to(torch.bfloat16))
    assert panel_w.dtype == torch.bfloat16 and torch.equal(panel_w[0, 2, :], weight[:16, 2].to(torch.bfloat16))
    assert "bfloat16" in repr(panel)
    with pytest.raises(ValueError, match="panel weights are float32 or bfloat16, not torch.float16"):
        PanelLinear(nn.Linear(3, 20), torch.float16)
