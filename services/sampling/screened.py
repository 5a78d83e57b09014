"""Temperature samples through the LM head screen: draws of softmax(l / T) without the float32 head.

A decode step's float32 LM head reads the whole [vocab, hidden] weight (622 MB on a 151,936 x 1,024 head) and,
at temperature, every one of its logits l is needed to draw a token.  The screen (services/models/head_screen.py)
reads a quarter or half of those bytes and gives every column j an upper value U_j >= l_j, by proof.  That is
what rejection sampling needs:

- propose a column j from exp(U / T) (the plain draw's inverse CDF, over U instead of l);
- compute l_j alone (one column of the head's panels: K products) and accept j with probability
  exp((l_j - U_j) / T), which is at most 1 because U_j >= l_j;
- else propose again from the same running sum (a new uniform and a binary search: no pass over the vocabulary).

An accepted j has probability exp(l_j / T) / sum_i exp(l_i / T): the float32 head's softmax, the distribution
the plain draw samples (both up to the float32 rounding of a running sum over the vocabulary).  A row expects
exp(mean(U - l) / T) proposals; one whose estimate passes MAX_GAP_OVER_T (a low temperature) or that found no
accepted column in MAX_ROUNDS x PER_ROUND proposals goes to the full head, as does a row whose U is not finite
or whose proposed column's logit ever lies above its U (the bound failed: never seen, and then not trusted).

Which rows: those `RowSampling.plain_sampled` (temperature only: no top-k, top-p, min-p, logprobs, penalties
or suppression).  A seeded row draws from a stream that depends only on (seed, output index), so its tokens do
not change with the batch it shares; they differ from the full head's draw of the same seed (another method).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch

from services.models.head_screen import HeadScreen
from services.sampling.sampler import RowSampling, _splitmix64

PER_ROUND = 8          # proposals per row drawn together (one binary search each, one batched column product)
MAX_ROUNDS = 8         # then the row goes to the full head (screened_draw.json counts how many did)
MAX_GAP_OVER_T = 3.0   # rows expecting more than e^3 ~ 20 proposals go to the full head at once
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def row_stream(row: RowSampling, rng: random.Random) -> int:
    """The 64-bit start of the row's proposal stream this step: from (seed, index) when seeded."""
    seed = row.params.seed
    if seed is None:
        return rng.getrandbits(64)
    return _splitmix64(_splitmix64(seed & (2 ** 64 - 1)) ^ row.index)


def uniforms(starts: np.ndarray, first: int, count: int) -> np.ndarray:
    """[rows, count] uniforms in [0, 1): numbers first .. first + count - 1 of each row's SplitMix64 stream."""
    with np.errstate(over="ignore"):
        z = starts[:, None] + _GOLDEN * (np.arange(first, first + count, dtype=np.uint64) + np.uint64(1))[None, :]
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def pick(screen: HeadScreen, hidden: torch.Tensor, rows: Sequence[RowSampling], rng: random.Random) -> list[int]:
    """Tokens of a step whose rows are all plain greedy or plain sampled, from its normed hidden states [R, K];
    -1 where the full head must decide."""
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    if len(greedy) == len(rows):
        return screen.argmax(hidden)
    tokens = [-1] * len(rows)
    if greedy:
        for i, token in zip(greedy, screen.argmax(hidden[greedy].contiguous()), strict=True):
            tokens[i] = token
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    x = hidden if not greedy else hidden[sampled].contiguous()
    drawn = draw(screen, x, [rows[i] for i in sampled], rng)
    for i, token in zip(sampled, drawn, strict=True):
        tokens[i] = token
    return tokens


@torch.inference_mode()
def draw(screen: HeadScreen, x: torch.Tensor, rows: Sequence[RowSampling], rng: random.Random) -> list[int]:
    """One token per row of x [R, K] (contiguous float32), each row plain sampled; -1: the full head decides."""
    stage = screen.int8
    assert stage is not None   # screen.samples
    count = len(rows)
    running, gaps, consts = stage.upper(x)
    temps = torch.tensor([row.params.temperature for row in rows], dtype=torch.float64)
    if bool((temps != 1.0).any()):
        running.div_(temps.float()[:, None])
    running.sub_(running.amax(dim=1, keepdim=True)).exp_().cumsum_(dim=1)   # each row's running sum of exp(U / T)
    totals = running[:, -1].double()
    pending = (torch.isfinite(totals) & (totals > 0) & (gaps / temps <= MAX_GAP_OVER_T)).tolist()
    starts = np.array([row_stream(row, rng) for row in rows], dtype=np.uint64)
    tokens = [-1] * count
    vocab = running.shape[1]
    for round_ in range(MAX_ROUNDS):
        live = [r for r in range(count) if pending[r]]
        if not live:
            break
        index = torch.tensor(live)
        u = torch.from_numpy(uniforms(starts[live], 2 * PER_ROUND * round_, 2 * PER_ROUND))
        targets = torch.zeros(count, PER_ROUND, dtype=torch.float64)   # every row searched: no copy of the sums
        targets[index] = u[:, 0::2] * totals[index, None]
        cols = torch.searchsorted(running, targets.float(), right=True).clamp_(max=vocab - 1)[index]
        width = running[index[:, None], cols] - running[index[:, None], (cols - 1).clamp(min=0)].masked_fill_(
            cols == 0, 0.0)
        logits, upper = stage.at(x, consts, index.repeat_interleave(PER_ROUND), cols.flatten())
        logits, upper = logits.view(-1, PER_ROUND).double(), upper.view(-1, PER_ROUND).double()
        broken = (logits > upper).any(dim=1).tolist()
        accept = (u[:, 1::2] < torch.exp((logits - upper) / temps[index, None])) & (width > 0)
        first = accept.to(torch.uint8).argmax(dim=1).tolist()
        took = accept.any(dim=1).tolist()
        for p, r in enumerate(live):
            if broken[p]:

                pending[r] = False
            elif took[p]:
                tokens[r] = int(cols[p, first[p]])
                pending[r] = False
    screen.sampled(count, sum(1 for token in tokens if token >= 0))
    return tokens
