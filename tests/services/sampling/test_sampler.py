"""Sampler: greedy, filters, penalties, min_tokens, and seeded draws independent of the batch."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.generation.params import DecodeParams
from services.protocol.errors import InvalidRequest
from services.sampling.sampler import RowSampling, Sampler, _draw_plain, sample_first_logprobs, seeded_uniform

VOCAB = 1000


def sample_first(logits: torch.Tensor, params: DecodeParams, **kw) -> int:
    return sample_first_logprobs(logits, params, **kw)[0]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits_row: torch.Tensor, params: DecodeParams, others: list[DecodeParams],
           steps: int = 30) -> list[int]:
    """Tokens of one request over `steps` draws, sharing each batch with `others`."""
    sampler = Sampler()
    row = RowSampling(params)
    neighbours = [RowSampling(p) for p in others]
    noise = _logits(len(others), seed=99)
    out = []
    for _ in range(steps):
        batch = torch.cat([noise, logits_row[None]])
        token = sampler.sample(batch, neighbours + [row])[-1]
        row.record(token)
        for n in neighbours:
            n.record(0)
        out.append(token)
    return out


def test_greedy_is_argmax_first_on_ties():
    logits = _logits(4)
    logits[2, 10] = logits[2, 500] = logits[2].max() + 1
    tokens = Sampler().sample(logits, [RowSampling(DecodeParams(temperature=0.0)) for _ in range(4)])
    assert tokens == logits.argmax(dim=1).tolist() and tokens[2] == 10


def test_seeded_draws_do_not_depend_on_the_batch():
    row = _logits(1, seed=3)[0]
    params = DecodeParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = _draws(row, params, [])
    mixes = [
        [DecodeParams(temperature=0.0)],
        [DecodeParams(temperature=1.0, top_k=5), DecodeParams(temperature=0.5)],
        [DecodeParams(temperature=1.3, top_p=0.5, seed=1), DecodeParams(min_p=0.2), DecodeParams(top_k=50)],
    ]
    for others in mixes:
        assert _draws(row, params, others) == alone
    assert _draws(row, DecodeParams(temperature=0.9, top_p=0.95, seed=1235), []) != alone


def test_seeded_uniform_is_a_pure_function():
    assert seeded_uniform(5, 3) == seeded_uniform(5, 3)
    values = [seeded_uniform(5, i) for i in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == 2000
    assert abs(sum(values) / len(values) - 0.5) < 0.03


@pytest.mark.parametrize("params", [DecodeParams(top_k=1), DecodeParams(top_p=1e-6), DecodeParams(min_p=1.0)])
def test_filters_that_leave_only_the_top_token(params):
    logits = _logits(3)
    tokens = Sampler(seed=0).sample(logits, [RowSampling(params) for _ in range(3)])
    assert tokens == logits.argmax(dim=1).tolist()


def test_temperature_sampling_follows_the_distribution():
    logits = torch.full((1, VOCAB), -math.inf)
    logits[0, 1], logits[0, 2], logits[0, 3] = 0.0, math.log(3), math.log(6)   # p = 0.1, 0.3, 0.6
    counts = Counter(sample_first(logits[0], DecodeParams(seed=s)) for s in range(3000))
    assert set(counts) == {1, 2, 3}
    for token, p in ((1, 0.1), (2, 0.3), (3, 0.6)):
        assert abs(counts[token] / 3000 - p) < 0.03
    top_k = Counter(sample_first(logits[0], DecodeParams(seed=s, top_k=2)) for s in range(500))
    assert set(top_k) == {2, 3}
    top_p = Counter(sample_first(logits[0], DecodeParams(seed=s, top_p=0.65)) for s in range(500))
    assert set(top_p) == {2, 3}                 # 0.6 < 0.65: the 0.3 token is needed, the 0.1 one is not
    min_p = Counter(sample_first(logits[0], DecodeParams(seed=s, min_p=0.4)) for s in range(500))
    assert set(min_p) == {2, 3}                 # 0.1 < 0.4 * 0.6


def test_a_plain_draw_is_the_inverse_cdf_of_the_softmax_in_place():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])                     # the last token suppressed (-inf)
    logits = torch.log(probs).repeat(6, 1) + torch.arange(6.0)[:, None]  # a shift per row changes nothing
    uniforms = torch.tensor([[0.05], [0.15], [0.35], [0.65], [0.95], [1.0]])
    # running mass 0.1 0.3 0.6 1.0: the first column past u; u * sum rounded to the sum takes the likeliest
    assert _draw_plain(logits, uniforms).flatten().tolist() == [0, 1, 2, 3, 3, 3]
    assert torch.allclose(logits[0], torch.tensor([0.1, 0.3, 0.6, 1.0, 1.0]) / 0.4)   # drawn in place: running sums


def test_an_engines_logits_drawn_in_place_still_give_true_logprobs():
    logits = _logits(3, seed=5)
    original = logits.clone()
    rows = [RowSampling(DecodeParams(temperature=0.7, seed=i, logprobs=2)) for i in range(3)]
    tokens = Sampler(logprobs_mode="processed_logprobs").sample(logits, rows, inplace=True)
    for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
        record = row.take_logprobs()   # of the distribution drawn from: the logits / the temperature
        assert record is not None and record.token_id == token
        assert abs(record.logprob - torch.log_softmax(original[i] / 0.7, dim=0)[token].item()) < 1e-5
    unread = [RowSampling(DecodeParams(temperature=0.7, seed=i)) for i in range(3)]
    assert Sampler().sample(original.clone(), unread, inplace=True) == tokens   # the same draws, no logprobs


def test_penalties():
    logits = torch.zeros(VOCAB)
    logits[:3] = torch.tensor([2.0, 1.9, -1.0])
    greedy = {"temperature": 0.0}
    row = RowSampling(DecodeParams(presence_penalty=0.5, **greedy))
    row.record(0)
    assert Sampler().sample(logits[None].clone(), [row]) == [1]
    row = RowSampling(DecodeParams(frequency_penalty=0.06, **greedy))
    row.record(0)
    assert Sampler().sample(logits[None].clone(), [row]) == [0]         # 2.0 - 0.06 > 1.9
    row.record(0)
    assert Sampler().sample(logits[None].clone(), [row]) == [1]         # 2.0 - 0.12 < 1.9
    row = RowSampling(DecodeParams(repetition_penalty=1.1, **greedy), prompt_token_ids=[0])
    assert Sampler().sample(logits[None].clone(), [row]) == [1]         # 2.0 / 1.1 < 1.9


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(VOCAB)
    logits[7], logits[8], logits[9] = 5.0, 4.0, 3.0                     # 7 = EOS, 8 = a stop id
    row = RowSampling(DecodeParams(temperature=0.0, min_tokens=2, stop_token_ids=[8]), eos_token_ids=[7])
    picks = []
    for _ in range(3):
        picks.append(Sampler().sample(logits[None].clone(), [row])[0])
        row.record(picks[-1])
    assert picks == [9, 9, 7]
    assert sample_first(logits, DecodeParams(temperature=0.0, min_tokens=1), eos_token_ids=[7]) == 8
    ignoring = DecodeParams(temperature=0.0, min_tokens=1, ignore_eos=True)
    assert sample_first(logits, ignoring, eos_token_ids=[7]) == 7


def test_params_are_validated():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}, {"min_p": 2},
                {"min_tokens": 5, "max_tokens": 2}, {"stop": [""]}, {"stop_token_ids": ["x"]}):
        with pytest.raises(InvalidRequest):
            DecodeParams(**bad)
    assert DecodeParams(stop="x").stop == ("x",)
