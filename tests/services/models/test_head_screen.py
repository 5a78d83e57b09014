"""The LM head screen (services/models/head_screen.py): the float32 head's greedy token on every row, by its
proven bound rather than a tolerance; rows it cannot decide go back to the full head; and the negative control
(the same screen trusting its bfloat16 values, bound 0) picks wrong tokens on adversarial rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.models.head_screen import CAP, HeadScreen, build_screen
from services.models.panel_linear import PanelLinear


def _linear(vocab: int, hidden: int, seed: int, std: float = 0.1) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(hidden, vocab, bias=False)
    nn.init.normal_(linear.weight, std=std)
    return linear


def _full_argmax(head: PanelLinear, x: torch.Tensor) -> list[int]:
    return head(x).max(dim=-1).indices.tolist()   # the first index among ties


KERNELS = ["pairs", "widened"] if HeadScreen(PanelLinear(nn.Linear(16, 16, bias=False))).kernel == "pairs" \
    else ["widened"]


@pytest.mark.skipif("pairs" not in KERNELS, reason="this CPU has no AVX512-BF16: the pair kernel is not built")
@torch.inference_mode()
def test_pair_kernel_values_at_every_row_count():
    """Every tile shape of the pair kernel (1-16 rows: 4-panel, 2-panel and split 8 + n row tiles, and the
    panels left over at the end of a thread's range) gives bfloat16(x) . bfloat16(W) within its bound."""
    linear = _linear(1000, 96, seed=3)
    head = PanelLinear(linear)   # 63 panels: a remainder for every tile width
    screen = HeadScreen(head, kernel="pairs")
    w = linear.weight.to(torch.bfloat16).double()
    for rows in range(1, 17):
        x = torch.randn(rows, 96)
        values, eps = screen.values(x)
        exact = x.to(torch.bfloat16).double() @ w.T
        assert values.shape == (rows, 1000)
        assert ((values.double() - exact).abs().max(dim=1).values <= 1e-4 * (1 + exact.abs().max())).all(), rows
        assert ((values.double() - x.double() @ linear.weight.double().T).abs() <= eps[:, None]).all(), rows


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("vocab, hidden", [(5003, 256), (49152, 577)])
@torch.inference_mode()
def test_every_row_gets_the_float32_heads_token(vocab, hidden, kernel):
    head = PanelLinear(_linear(vocab, hidden, seed=vocab))
    screen = HeadScreen(head, kernel=kernel)
    assert screen.kernel == kernel
    for rows in (1, 3, 8, 16):
        for scale in (0.1, 1.0, 30.0):
            x = torch.randn(rows, hidden) * scale
            assert screen.argmax(x) == _full_argmax(head, x), (rows, scale)
    assert (screen.rows_screened, screen.rows_full) == (3 * (1 + 3 + 8 + 16), 0)
    assert screen.rows_screened <= screen.candidates <= 4 * screen.rows_screened   # a few float32 logits per row
    assert screen.extra_bytes in (head.weight.numel() * 2,                    # one bfloat16 copy of the head
                                  head.weight.numel() * 2 + head.weight.shape[0] * 16 * 2)   # (K padded even)


@pytest.mark.parametrize("kernel", KERNELS)
@torch.inference_mode()
def test_ties_go_to_the_first_index_and_a_near_tie_below_bfloat16_is_decided_in_float32(kernel):
    linear = _linear(4000, 64, seed=1, std=0.01)
    w = linear.weight
    w[2500] = w[100] = w[3900] = torch.linspace(-1, 1, 64)        # three identical rows: an exact tie
    # rows 700 and 1800 differ only below bfloat16's resolution, in opposite directions: 700 rounds up
    # (1 + 2^-8 + 2^-12 -> 1 + 2^-7) and 1800 down, so the screen ranks 700 first while float32 ranks 1800
    # first (1800's second weight, 0.5 + 3 * 2^-12, rounds to 0.5)
    w[700] = w[1800] = 0.0
    w[700, 0], w[700, 1] = 1 + 2 ** -8 + 2 ** -12, 0.5
    w[1800, 0], w[1800, 1] = 1 + 2 ** -8 - 2 ** -12, 0.5 + 3 * 2 ** -12
    head = PanelLinear(linear)
    screen = HeadScreen(head, kernel=kernel)
    tie = torch.linspace(-1, 1, 64)[None] * 3
    near = torch.zeros(1, 64)
    near[0, :2] = 1.0
    x = torch.cat([tie, near])
    assert _full_argmax(head, x) == [100, 1800]
    assert screen.argmax(x) == [100, 1800]
    # negative control: trusting the bfloat16 values (no bound) takes the screen's own favourite
    assert screen.argmax(near, bound_scale=0.0) == [700]


@pytest.mark.parametrize("kernel", KERNELS)
@torch.inference_mode()
def test_rows_it_cannot_decide_go_back_to_the_full_head(kernel):
    linear = _linear(3000, 32, seed=2)
    linear.weight[:CAP + 1] = linear.weight[0]                     # CAP + 1 identical rows: too many candidates
    screen = HeadScreen(PanelLinear(linear), kernel=kernel)
    crowded = linear.weight[0][None].clone() * 10
    bad = torch.randn(2, 32)
    bad[0, 3], bad[1, 5] = float("nan"), float("inf")
    assert screen.argmax(torch.cat([crowded, bad])) == [-1, -1, -1]
    assert (screen.rows_screened, screen.rows_full) == (0, 3)


def test_it_applies_to_float32_panel_heads_without_a_bias_and_says_why_not():
    linear = _linear(100, 16, seed=3)
    screen, report = build_screen(PanelLinear(linear), "on")
    assert screen is not None and report.enabled and f"bfloat16 panels, {screen.kernel}" in report.line()
    assert build_screen(PanelLinear(linear), "auto")[1].line() == (
        "lm head screen off (hidden size 16 < 256: not worth it (auto))")
    assert build_screen(PanelLinear(_linear(100, 256, seed=4)), "auto")[0] is not None
    assert build_screen(PanelLinear(linear), "off")[1].line() == "lm head screen off (--lm-head-screen off)"
    for head, why in ((linear, "the LM head screen needs a float32 panel head"),
                      (PanelLinear(linear, torch.bfloat16), "the LM head screen needs a float32 panel head"),
                      (PanelLinear(nn.Linear(16, 100)), "the LM head screen needs a head without a bias")):
        screen, report = build_screen(head, "auto")
        assert screen is None and report.line() == f"lm head screen off ({why})"
        with pytest.raises(ValueError, match=f"--lm-head-screen on: {why}"):
            build_screen(head, "on")
    with pytest.raises(ValueError, match="unknown --lm-head-screen 'fast'; supported: auto, on, off"):
        build_screen(linear, "fast")
