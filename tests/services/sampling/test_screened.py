"""Temperature draws through the LM head screen (services/sampling/screened.py): rejection sampling on the int8
screen's upper values gives the float32 head's softmax, seeded rows keep their tokens whatever shares the batch,
and rows the screen cannot serve go back to the full head."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from services.generation.params import DecodeParams
from services.kernels import loader
from services.models.head_screen import JUDGE_ROWS, HeadScreen
from services.models.panel_linear import PanelLinear
from services.sampling import screened
from services.sampling.sampler import RowSampling

pytestmark = pytest.mark.skipif(not loader.expected("head_int8"),
                                reason="this CPU has no AVX512-VNNI: the int8 kernel is not built")
VOCAB, HIDDEN = 3000, 256


def _head(seed: int = 0) -> PanelLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False)
    nn.init.normal_(linear.weight, std=0.1)
    with torch.no_grad():   # columns of very different norms: their int8 errors, so their bounds, differ
        linear.weight.mul_(torch.linspace(0.2, 3.0, VOCAB)[torch.randperm(VOCAB)][:, None])
    return PanelLinear(linear)


def _rows(count: int, temperature: float = 1.0, seed: int | None = None, index: int = 0) -> list[RowSampling]:
    return [RowSampling(DecodeParams(temperature=temperature, seed=seed, max_tokens=100), index=index)
            for _ in range(count)]


def _chi2(counts: torch.Tensor, probs: torch.Tensor, bins: int = 40) -> float:
    """Pearson's statistic over the `bins` - 1 likeliest columns, each on its own, and all the others together."""
    top = probs.topk(bins - 1).indices
    rest = torch.ones_like(probs, dtype=torch.bool)
    rest[top] = False
    expected = torch.cat([probs[top], probs[rest].sum()[None]])
    seen = torch.cat([counts[top], counts[rest].sum()[None]])
    total = counts.sum()
    return float(((seen - total * expected) ** 2 / (total * expected)).sum())


def _counts(screen: HeadScreen, x: torch.Tensor, temperature: float, draws: int) -> torch.Tensor:
    rng = random.Random(5)
    batch = x.repeat(500, 1).contiguous()
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    left = 0
    while counts.sum() < draws:
        for token in screened.draw(screen, batch, _rows(500, temperature), rng):
            if token >= 0:
                counts[token] += 1
            else:
                left += 1   # no proposal accepted: the full head draws it (an accepted one is unbiased either way)
    assert left < draws / 1000
    return counts


def test_upper_values_bound_every_logit_and_the_pairs_are_the_heads_own_bits():
    head = _head()
    screen = HeadScreen(head, kernel="int8")
    x = torch.randn(9, HIDDEN)
    x[3] *= 40.0                       # a large row
    x[5, :4] = 25.0                    # a row with a few huge components
    logits = head(x)
    upper, gaps, consts = screen.int8.upper(x)
    assert bool((upper >= logits).all())
    assert gaps.shape == (9,) and bool((gaps > 0).all())
    rows = torch.arange(9).repeat_interleave(7)
    cols = torch.randint(0, VOCAB, (63,))
    logit, up = screen.int8.at(x, consts, rows, cols)
    assert torch.equal(logit, logits[rows, cols])      # the full head's bits, not within a tolerance
    assert torch.equal(up, upper[rows, cols])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_float32_heads_softmax(temperature):
    """The 39 likeliest columns and the rest: the statistic's 99.9th percentile at 39 degrees of freedom is 72.  The
    negative control: proposals taken without the acceptance step follow softmax(U / T), and the test sees it
    (it fails the same threshold)."""
    head = _head()
    screen = HeadScreen(head, kernel="int8")
    torch.manual_seed(3)
    x = torch.randn(1, HIDDEN)
    probs = torch.softmax(head(x)[0].double() / temperature, 0)
    counts = _counts(screen, x, temperature, 30_000)
    assert _chi2(counts, probs) < 72.0
    upper = screen.int8.upper(x)[0][0].double()
    proposal = torch.softmax(upper / temperature, 0)
    draws = torch.multinomial(proposal, 30_000, replacement=True, generator=torch.Generator().manual_seed(1))
    assert _chi2(torch.bincount(draws, minlength=VOCAB).double(), probs) > 72.0


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    screen = HeadScreen(_head(), kernel="int8")
    torch.manual_seed(4)
    x = torch.randn(6, HIDDEN)
    alone = [screened.draw(screen, x[i:i + 1].contiguous(), _rows(1, 0.8, seed=11, index=i), random.Random(i))[0]
             for i in range(6)]
    rows = [_rows(1, 0.8, seed=11, index=i)[0] for i in range(6)]
    together = screened.draw(screen, x, rows, random.Random(99))
    assert together == alone and min(alone) >= 0
    later = screened.draw(screen, x, [_rows(1, 0.8, seed=11, index=i + 1)[0] for i in range(6)], random.Random(0))
    assert later != together                         # the next output index draws afresh


def test_rows_the_screen_cannot_serve_go_to_the_full_head_and_enough_of_them_turn_it_off():
    screen = HeadScreen(_head(), kernel="int8")
    x = torch.randn(4, HIDDEN)
    x[1, 7] = float("nan")
    picked = screened.draw(screen, x, _rows(2, 1.0) + _rows(2, 0.001), random.Random(0))
    assert picked[0] >= 0 and picked[1:] == [-1, -1, -1]    # NaN row; T so low the expected proposals are too many
    assert screen.samples
    while screen.draws[0] < JUDGE_ROWS:
        screened.draw(screen, x[2:].contiguous(), _rows(2, 0.001), random.Random(0))
    assert not screen.samples                      # auto leaves temperature rows to the full head for good


def test_pick_splits_a_mixed_step_between_the_argmax_and_the_draw():
    head = _head()
    screen = HeadScreen(head, kernel="int8")
    x = torch.randn(5, HIDDEN)
    rows = [_rows(1, 0.0)[0], *_rows(2, 1.0, seed=3), _rows(1, 0.0)[0], _rows(1, 1.0, seed=4)[0]]
    picked = screened.pick(screen, x, rows, random.Random(0))
    greedy = head(x).argmax(dim=1).tolist()
    assert picked[0] == greedy[0] and picked[3] == greedy[3]
    assert picked[1:3] + picked[4:] == screened.draw(screen, x[[1, 2, 4]].contiguous(), rows[1:3] + rows[4:],
                                                      random.Random(1))
