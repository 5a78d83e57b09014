from __future__ import annotations

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.parsing import parse_model
from services.protocol.sampling import SamplingParams


def _error(body: dict) -> str:
    with pytest.raises(InvalidRequest) as caught:
        parse_model(SamplingParams, body)
    return caught.value.message


def test_defaults():
    params = SamplingParams()
    assert params.max_tokens is None  # the server applies its own default, never 16
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.stop == [] and params.stop_token_ids == [] and params.n == 1
    assert params.skip_special_tokens is True and params.include_stop_str_in_output is False
    assert params.repetition_penalty == 1.0 and params.extra_args is None and params.logprobs is None


def test_null_means_default():
    nulls = {"temperature": None, "top_p": None, "stop": None, "max_tokens": None}
    params = parse_model(SamplingParams, nulls)
    assert (params.temperature, params.top_p, params.stop, params.max_tokens) == (1.0, 1.0, [], None)


def test_stop_string_becomes_list():
    assert parse_model(SamplingParams, {"stop": "###"}).stop == ["###"]
    assert parse_model(SamplingParams, {"stop": ["a", "b"]}).stop == ["a", "b"]
    assert _error({"stop": ""}) == "stop: must not contain an empty string"


def test_top_k_off_values():
    assert [parse_model(SamplingParams, {"top_k": k}).top_k for k in (-1, 0, 5)] == [-1, 0, 5]
    assert _error({"top_k": -2}) == "top_k: must be -1 or 0 (off) or a positive integer"


def test_n_is_between_one_and_the_cap_and_never_greedy():
    assert _error({"n": 129}) == "n: must be between 1 and 128, got 129"
    assert _error({"n": 0}) == "n: must be between 1 and 128, got 0"
    assert parse_model(SamplingParams, {"n": 8}).n == 8
    assert "n must be 1 when using greedy sampling, got 3." in _error({"n": 3, "temperature": 0})   # vLLM's words
    assert parse_model(SamplingParams, {"n": 3, "temperature": 0.5}).n == 3


@pytest.mark.parametrize(("body", "message"), [
    ({"max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"temperature": -0.1}, "temperature: must be >= 0.0"),
    ({"top_p": 0}, "top_p: must be > 0.0"),
    ({"top_p": 1.01}, "top_p: must be <= 1.0"),
    ({"min_p": 2}, "min_p: must be <= 1.0"),
    ({"repetition_penalty": 0}, "repetition_penalty: must be > 0.0"),
    ({"presence_penalty": 2.5}, "presence_penalty: must be <= 2.0"),
    ({"frequency_penalty": -3}, "frequency_penalty: must be >= -2.0"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]: must be >= 0"),
    ({"min_tokens": -1}, "min_tokens: must be >= 0"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens (3) must be <= max_tokens (2)"),
    ({"seed": 2**64}, "seed: must be <= 9223372036854775807"),
    ({"extra_args": [1]}, "extra_args: must be an object"),
])
def test_rules(body, message):
    assert _error(body) == message


def test_greedy_and_all_fields_accepted():
    body = {"max_tokens": 8, "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
            "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True, "min_tokens": 1, "logprobs": 2,
            "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "n": 1,
            "extra_args": {"x": 1}, "skip_special_tokens": False, "include_stop_str_in_output": True}
    params = parse_model(SamplingParams, body)
    carried = {"detokenize": True, "output_kind": 0, "skip_clone": False, "bad_words": [],
               "skip_reading_prefix_cache": None, "prompt_logprobs": None}  # vLLM's render fields, defaults
    assert params.is_greedy and params.model_dump() == {**body, "temperature": 0.0, **carried}


@pytest.mark.parametrize(("body", "message"), [
    ({"bad_words": ["x"]}, "bad_words: bad_words is not supported"),
    ({"skip_reading_prefix_cache": True},
     "skip_reading_prefix_cache: true is not supported (epd's prefix cache is always read)"),
    ({"output_kind": 3}, "output_kind: must be <= 2"),
])
def test_vllm_fields_epd_cannot_honour_are_refused(body, message):
    assert _error(body) == message
