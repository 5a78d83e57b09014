"""Logprobs from the sampler: raw model logprobs of the sampled token and the top n, only for rows that ask;
and the three answer shapes built from them (vLLM's GenerateLogProbs, OpenAI chat and completions)."""

from __future__ import annotations

import pytest
import torch

from services.generation.params import DecodeParams
from services.protocol.errors import InvalidRequest
from services.protocol.logprobs import (
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    generate_logprobs,
    loads_list,
)
from services.sampling.sampler import RowSampling, Sampler, sample_first_logprobs

VOCAB = 500


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_only_rows_that_ask_get_logprobs_from_the_raw_distribution():
    logits = _logits(3)
    raw = torch.log_softmax(logits, dim=-1)
    rows = [RowSampling(DecodeParams(temperature=0, logprobs=4)), RowSampling(DecodeParams(temperature=0)),
            RowSampling(DecodeParams(temperature=0.7, seed=3, repetition_penalty=1.5, logprobs=0),
                        prompt_token_ids=[int(logits[2].argmax())])]
    tokens = Sampler().sample(logits.clone(), rows, inplace=True)
    first, none, third = (row.take_logprobs() for row in rows)
    assert none is None and rows[0].take_logprobs() is None  # taken once
    assert first.token_id == tokens[0] == int(raw[0].argmax()) and first.rank == 1
    assert first.logprob == pytest.approx(float(raw[0, tokens[0]]), abs=1e-6)
    values, ids = raw[0].topk(4)
    assert first.top_ids == tuple(ids.tolist())
    assert first.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    assert list(first.top_logprobs) == sorted(first.top_logprobs, reverse=True)
    # penalties and temperature change the draw, not the reported (raw) logprobs
    assert third.token_id == tokens[2] and third.top_ids == ()
    assert third.logprob == pytest.approx(float(raw[2, tokens[2]]), abs=1e-6)
    assert third.rank == int((raw[2] >= raw[2, tokens[2]]).sum())


def test_prefill_first_token_logprobs():
    logits = _logits(1, seed=5)[0]
    token, record = sample_first_logprobs(logits, DecodeParams(temperature=0, logprobs=2))
    assert record is not None and record.token_id == token and record.rank == 1 and len(record.top_ids) == 2
    assert sample_first_logprobs(logits, DecodeParams(temperature=0)) == (token, None)


@pytest.mark.parametrize("value", [-1, 21])
def test_logprobs_out_of_range_are_refused(value):
    with pytest.raises(InvalidRequest, match=r"logprobs must be in \[0, 20\]"):
        DecodeParams(logprobs=value)


SAMPLED_THIRD = TokenLogprob(7, -2.5, 3, (4, 9, 7), (-0.5, -1.0, -2.5), "c", ("a", "b", "c"))


def test_generate_shape_is_vllms_engine_order():
    """vLLM: the sampled token first, then the rest by rank; max(n, 1) entries; integer ids."""
    body = generate_logprobs([SAMPLED_THIRD, TokenLogprob(4, -0.1, 1, (), (), "a", ())])
    assert body == {"content": [
        {"token_id": 7, "logprob": -2.5, "rank": 3, "top_logprobs": [
            {"token_id": 7, "logprob": -2.5, "rank": 3}, {"token_id": 4, "logprob": -0.5, "rank": 1},
            {"token_id": 9, "logprob": -1.0, "rank": 2}]},
        {"token_id": 4, "logprob": -0.1, "rank": 1, "top_logprobs": [{"token_id": 4, "logprob": -0.1, "rank": 1}]}]}


def test_openai_shapes():
    chat = chat_logprobs([SAMPLED_THIRD])["content"][0]
    assert chat["token"] == "c" and chat["bytes"] == [99] and chat["logprob"] == -2.5
    assert [t["token"] for t in chat["top_logprobs"]] == ["a", "b", "c"]  # the n most likely, sorted
    done = completion_logprobs([SAMPLED_THIRD, TokenLogprob(4, float("-inf"), 1, (4,), (float("nan"),), "ab",
                                                            ("ab",))], text_offset=10)
    assert done == {"text_offset": [10, 11], "token_logprobs": [-2.5, -9999.0], "tokens": ["c", "ab"],
                    "top_logprobs": [{"c": -2.5, "a": -0.5, "b": -1.0}, {"ab": -9999.0}]}


def test_records_round_trip_as_json():
    assert loads_list([SAMPLED_THIRD.to_json()]) == [SAMPLED_THIRD]


def _vllm_processed(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """vLLM's CPU sampler, written out: temperature, then min_p, then top-k, then top-p (sorted ascending)."""
    x = row.clone() / temperature
    probs = x.softmax(-1)
    x[probs < min_p * probs.max()] = float("-inf")
    x[x < x.topk(top_k).values[-1]] = float("-inf")
    values, order = x.sort()
    drop = values.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[-1] = False
    x[order[drop]] = float("-inf")
    return x


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_vllms_values(mode):
    logits = _logits(2, seed=9)
    params = [DecodeParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, seed=1, logprobs=5,
                           repetition_penalty=1.3),
              DecodeParams(temperature=0, logprobs=3)]
    rows = [RowSampling(params[0], prompt_token_ids=[int(logits[0].argmax())]), RowSampling(params[1])]
    tokens = Sampler(logprobs_mode=mode).sample(logits.clone(), rows, inplace=True)
    penalized = logits[0].clone()
    top = int(logits[0].argmax())
    penalized[top] = penalized[top] / 1.3 if penalized[top] > 0 else penalized[top] * 1.3
    expected = {"raw_logprobs": [torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1], -1)],
                "raw_logits": [logits[0], logits[1]],
                "processed_logits": [_vllm_processed(penalized, 0.7, 50, 0.9, 0.01), logits[1]],
                "processed_logprobs": [torch.log_softmax(_vllm_processed(penalized, 0.7, 50, 0.9, 0.01), -1),
                                       torch.log_softmax(logits[1], -1)]}[mode]
    for row, token, want in zip(rows, tokens, expected, strict=True):
        record = row.take_logprobs()
        assert record.token_id == token
        assert record.logprob == pytest.approx(float(want[token]), abs=1e-5)
        values, ids = want.topk(len(record.top_ids))
        assert record.top_ids == tuple(ids.tolist())
        assert record.top_logprobs == pytest.approx(values.tolist(), abs=1e-5)
        assert record.rank == int((want >= want[token]).sum())
    assert mode.startswith("raw") or float(expected[0][tokens[0]]) > float("-inf")   # drawn from what is kept


def test_tokens_as_ids_follow_vllms_shapes():
    """return_tokens_as_token_ids: chat keeps a sampled token's text bytes (vLLM reads them from its decoded
    token), top entries and completions carry the placeholder; generate's text mode has no bytes at all."""
    from services.protocol.logprobs import as_token_ids, text_logprobs

    [chat] = chat_logprobs([SAMPLED_THIRD], as_ids=True)["content"]
    assert (chat["token"], chat["bytes"]) == ("token_id:7", [99])
    assert [(t["token"], t["bytes"]) for t in chat["top_logprobs"]] == [
        (f"token_id:{i}", list(f"token_id:{i}".encode())) for i in (4, 9, 7)]
    done = completion_logprobs(as_token_ids([SAMPLED_THIRD]))
    assert done["tokens"] == ["token_id:7"] and set(done["top_logprobs"][0]) == {"token_id:7", "token_id:4",
                                                                                "token_id:9"}
    [text] = text_logprobs([SAMPLED_THIRD], as_ids=True)["content"]
    assert (text["token"], text["bytes"]) == ("token_id:7", None)
    assert [t["token"] for t in text["top_logprobs"]] == ["token_id:7", "token_id:4", "token_id:9"]
