"""The LM head screen (services/models/head_screen.py): the float32 head's greedy token on every row, by its
proven bound rather than a tolerance; rows it cannot decide go back to the full head; and the negative control
(the same screen trusting its bfloat16 values, bound 0) picks wrong tokens on adversarial rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.kernels import loader
from services.models.head_screen import CAP, JUDGE_ROWS, HeadScreen, build_screen
from services.models.panel_linear import PanelLinear


def _linear(vocab: int, hidden: int, seed: int, std: float = 0.1) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(hidden, vocab, bias=False)
    nn.init.normal_(linear.weight, std=std)
    return linear


def _full_argmax(head: PanelLinear, x: torch.Tensor) -> list[int]:
    return head(x).max(dim=-1).indices.tolist()   # the first index among ties


def _kernels() -> list[str]:
    """The screen kernels this CPU must run (int8: AVX512-VNNI; pairs: AVX512-BF16; widened: AVX2), from its
    features, not from what loaded: a kernel the CPU can run that is not loaded fails these tests, never skips."""
    found = ["int8"] if loader.expected("head_int8") else []
    found += ["pairs"] if loader.expected("panel_bf16") == "avx512_bf16" else []
    return [*found, "widened"]


KERNELS = _kernels()


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
    for rows in (1, 3, 8, 13, 20):
        for scale in (0.1, 1.0, 30.0):
            x = torch.randn(rows, hidden) * scale
            assert screen.argmax(x) == _full_argmax(head, x), (rows, scale)
    assert (screen.rows_screened, screen.rows_full) == (3 * (1 + 3 + 8 + 13 + 20), 0)
    if kernel == "int8":   # a quarter of the head's bytes (K padded to 4, panels to pairs) and 4 numbers per column
        panels = head.weight.shape[0] + head.weight.shape[0] % 2
        assert screen.extra_bytes == panels * 16 * ((hidden + 3) // 4 * 4 + 4 + 3 * 8)
        assert screen.rows_screened <= screen.candidates <= 64 * screen.rows_screened   # tens of columns a row
    else:
        assert screen.rows_screened <= screen.candidates <= 4 * screen.rows_screened   # a few float32 logits a row
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
    screen = HeadScreen(PanelLinear(linear), cap=CAP, kernel=kernel)
    crowded = linear.weight[0][None].clone() * 10
    bad = torch.randn(2, 32)
    bad[0, 3], bad[1, 5] = float("nan"), float("inf")
    assert screen.argmax(torch.cat([crowded, bad])) == [-1, -1, -1]
    assert (screen.rows_screened, screen.rows_full) == (0, 3)


def test_it_applies_to_float32_panel_heads_without_a_bias_and_says_why_not():
    linear = _linear(100, 16, seed=3)
    screen, report = build_screen(PanelLinear(linear), "on")
    assert screen is not None and report.enabled
    assert ("int8 panels, a scale and a bound per column" if screen.kernel == "int8"
            else f"bfloat16 panels, {screen.kernel}") in report.line()
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


@pytest.mark.skipif("int8" not in KERNELS, reason="this CPU has no AVX512-VNNI: the int8 kernel is not built")
@torch.inference_mode()
def test_int8_keeps_the_argmax_while_its_lists_fill_and_compact():
    """Logits that rise column after column: every column beats the lower bound of all before it, so each
    kernel thread's list for the row fills and must be compacted by the risen bound, again and again; the
    token is still the float32 head's (the last column), and a list that cannot be compacted sends the row to
    the full head."""
    hidden, vocab = 64, 6000
    direction = torch.randn(hidden)
    linear = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        rising = torch.linspace(0.5, 1.5, vocab)[:, None] * direction[None]
        linear.weight.copy_(rising + 1e-3 * torch.randn(vocab, hidden))
    head = PanelLinear(linear)
    screen = HeadScreen(head, kernel="int8")
    screen.int8.cap = screen.int8.list_cap = 512           # 6000 columns: each thread's list fills several times
    x = direction[None] * 4
    assert _full_argmax(head, x) == screen.argmax(x)
    flat = torch.zeros(1, hidden)                               # every logit 0: nothing ever leaves the list
    assert screen.argmax(flat) == [-1]
    assert _full_argmax(head, flat) == [0]


@pytest.mark.skipif("int8" not in KERNELS, reason="this CPU has no AVX512-VNNI: the int8 kernel is not built")
@torch.inference_mode()
def test_int8_decides_below_its_own_resolution_and_its_bound_is_what_makes_it_right():
    """Columns 700 and 1800 differ by less than one int8 step: int8 ranks 700 first (its weight 0.504 rounds to
    64/127 = 0.50394 at 700's scale, 1800's 0.5045 to 50/100 at its coarser one), float32 ranks 1800 first.  With
    its bound the screen answers 1800; trusting the int8 values (bound 0) answers 700: the negative control."""
    linear = _linear(4000, 64, seed=5, std=0.01)
    w = linear.weight
    w[700] = w[1800] = 0.0
    w[700, 0], w[700, 1] = 1.0, 0.504
    w[1800, 0], w[1800, 1], w[1800, 2] = 1.0, 0.5045, 1.27     # 1.27 sets 1800's scale to 0.01 (x[2] = 0)
    head = PanelLinear(linear)
    screen = HeadScreen(head, kernel="int8")
    x = torch.zeros(1, 64)
    x[0, :2] = 1.0
    assert _full_argmax(head, x) == [1800]
    assert screen.argmax(x) == [1800]
    assert screen.argmax(x, bound_scale=0.0) == [700]


@pytest.mark.skipif(not {"int8", "pairs"} <= set(KERNELS), reason="needs AVX512-VNNI and AVX512-BF16")
@torch.inference_mode()
def test_auto_leaves_int8_for_the_pairs_when_the_rows_carry_huge_components():
    """auto starts on int8 and judges it on the first JUDGE_ROWS real rows.  Rows with a few huge components
    (as SmolLM2's hidden states) quantize coarsely and the int8 bound keeps too many columns: auto moves to
    the bfloat16 pairs for good, and every token stays the float32 head's.  Plain rows keep int8."""
    linear = _linear(20000, 256, seed=6, std=0.05)
    linear.weight[:, :4] *= 0.05          # huge components the head barely reads: they set x's int8 step alone
    head = PanelLinear(linear)
    plain, spiky = HeadScreen(head), HeadScreen(head)
    assert plain.kernel == spiky.kernel == "int8" and plain.judging
    gen = torch.Generator().manual_seed(7)
    for _ in range(JUDGE_ROWS // 16):
        x = torch.randn(16, 256, generator=gen)
        assert plain.argmax(x) == _full_argmax(head, x)
        x[:, :4] *= 30.0                                          # four huge components per row
        full = _full_argmax(head, x)
        assert [token if token >= 0 else full[i] for i, token in enumerate(spiky.argmax(x))] == full
    assert (plain.kernel, plain.judging, plain.switched) == ("int8", False, "")
    assert spiky.kernel == "pairs" and spiky.int8 is None and "to the full head" in spiky.switched
    x = torch.randn(16, 256, generator=gen)
    x[:, :4] *= 30.0
    full, tokens = _full_argmax(head, x), spiky.argmax(x)
    assert [token if token >= 0 else full[i] for i, token in enumerate(tokens)] == full
    assert sum(token < 0 for token in tokens) <= 4 and spiky.extra_bytes == head.weight.numel() * 2
