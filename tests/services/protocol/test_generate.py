from __future__ import annotations

import json

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.generate import (
    AbortRequest,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChunk,
    response_id,
)
from services.protocol.parsing import parse_model

FEATURES = {
    "mm_hashes": {"image": ["h0"]},
    "mm_placeholders": {"image": [{"offset": 1, "length": 3}]},
    "kwargs_data": {"image": ["a2l3"]},
    "mm_metadata": {"image": ["bWV0YQ=="]},
}


def _request(**fields) -> dict:
    return {"token_ids": [9, 5, 5, 5, 7], **fields}


def _error(body: dict) -> str:
    with pytest.raises(InvalidRequest) as caught:
        parse_model(GenerateRequest, body)
    return caught.value.message


def test_minimal_request_defaults():
    request = parse_model(GenerateRequest, {"token_ids": [1]})
    assert len(request.request_id) == 32 and request.request_id != parse_model(
        GenerateRequest, {"token_ids": [1]}).request_id
    assert request.sampling_params.max_tokens is None and request.stream is False
    assert request.priority == 0 and request.model is None and request.items() == []


def test_token_ids_rules():
    assert _error({"token_ids": []}) == "token_ids: must not be empty"
    assert _error({"token_ids": [1, -1]}) == "token_ids[1]: must be >= 0"
    assert _error({"token_ids": [2**31]}) == "token_ids[0]: must be <= 2147483647"


def test_content_parts_and_features_are_mutually_exclusive():
    parts = [{"type": "image_url", "url": "http://x/cat.png"}]
    assert _error(_request(features=FEATURES, content_parts=parts)) == (
        "content_parts and features are mutually exclusive")
    assert parse_model(GenerateRequest, _request(content_parts=parts)).content_parts


def test_placeholder_must_fit_in_token_ids():
    features = {**FEATURES, "mm_placeholders": {"image": [{"offset": 3, "length": 3}]}}
    assert _error(_request(features=features)) == (
        "features.mm_placeholders.image[0]: offset+length (6) exceeds len(token_ids) (5)")
    features["mm_placeholders"] = {"image": [{"offset": 2, "length": 3}]}
    assert parse_model(GenerateRequest, _request(features=features)).items()[0].placeholder.end == 5


def test_metadata_only_items_require_ec_transfer_params():
    metadata_only = {**FEATURES, "kwargs_data": None}
    assert _error(_request(features=metadata_only)) == (
        "metadata-only multimodal items require ec_transfer_params")
    assert _error(_request(features={**FEATURES, "kwargs_data": {"image": [None]}})) == (
        "metadata-only multimodal items require ec_transfer_params")
    assert _error(_request(features=metadata_only, ec_transfer_params={})) == (
        "metadata-only multimodal items require ec_transfer_params")
    ok = parse_model(GenerateRequest, _request(features=metadata_only, ec_transfer_params={"h0": {"k": 1}}))
    assert ok.items()[0].metadata_b64 == "bWV0YQ==" and ok.items()[0].kwargs_b64 is None
    # still carrying kwargs_data: unchanged rules, no EC params needed
    assert parse_model(GenerateRequest, _request(features=FEATURES)).items()[0].kwargs_b64 == "a2l3"


def test_metadata_only_accepts_nested_ec_transfer_params():
    body = _request(features={**FEATURES, "kwargs_data": None},
                    sampling_params={"extra_args": {"ec_transfer_params": {"h0": {"k": 1}}}})
    assert parse_model(GenerateRequest, body).ec_transfer_params == {"h0": {"k": 1}}


def test_transfer_params_nested_in_extra_args_are_lifted():
    body = _request(sampling_params={"extra_args": {"kv_transfer_params": {"do_remote_decode": True},
                                                    "ec_transfer_params": {"h": {}}, "other": 1}})
    request = parse_model(GenerateRequest, body)
    assert request.kv_transfer_params == {"do_remote_decode": True}
    assert request.ec_transfer_params == {"h": {}}
    assert request.sampling_params.extra_args == {"other": 1}


def test_top_level_transfer_params_win():
    body = _request(kv_transfer_params={"top": 1},
                    sampling_params={"extra_args": {"kv_transfer_params": {"nested": 1}}})
    request = parse_model(GenerateRequest, body)
    assert request.kv_transfer_params == {"top": 1} and request.sampling_params.extra_args is None
    # the normalized request serializes with the effective value only, and re-parses the same
    again = parse_model(GenerateRequest, request.model_dump_json().encode())
    assert again == request


def test_nested_transfer_params_must_be_objects():
    body = _request(sampling_params={"extra_args": {"kv_transfer_params": "x"}})
    assert _error(body) == "sampling_params.extra_args.kv_transfer_params: must be an object"


def test_lifting_does_not_mutate_the_callers_sampling_params():
    from services.protocol.sampling import SamplingParams

    params = SamplingParams(extra_args={"kv_transfer_params": {"a": 1}})
    GenerateRequest(token_ids=[1], sampling_params=params)
    assert params.extra_args == {"kv_transfer_params": {"a": 1}}


def test_cache_salt_length():
    # vLLM's validate_cache_salt: non-empty, <= 128 characters, none of '@', '/', '\\', NUL
    assert _error(_request(cache_salt="")) == "cache_salt: must be a non-empty string"
    rule = "cache_salt: must be at most 128 characters and must not contain '@', '/', '\\', or NUL"
    for bad in ("x" * 129, "a@b", "a/b", "a\\b", "a\0b"):
        assert _error(_request(cache_salt=bad)) == rule, bad
    assert parse_model(GenerateRequest, _request(cache_salt="x" * 128)).cache_salt == "x" * 128


def test_full_render_answer_round_trips():
    body = _request(request_id="r1", features=FEATURES, sampling_params={"max_tokens": 4, "stop": "x"},
                    model="m", stream=True, stream_options={"include_usage": True}, cache_salt="s",
                    priority=3)
    request = parse_model(GenerateRequest, json.dumps(body))
    assert request.stream_options.include_usage and not request.stream_options.continuous_usage_stats
    assert request.sampling_params.stop == ["x"] and request.priority == 3
    assert parse_model(GenerateRequest, request.model_dump()) == request


def test_n_checked_through_generate():
    assert "n: must be between 1 and 128, got 129" in _error(_request(sampling_params={"n": 129}))
    assert parse_model(GenerateRequest, _request(sampling_params={"n": 8})).sampling_params.n == 8


def test_response_id():
    assert response_id("abc") == "generate-tokens-abc"
    assert response_id("abc", "hdr-1") == "generate-tokens-hdr-1"
    assert response_id("abc", "") == "generate-tokens-abc"
    assert response_id("generate-tokens-abc") == "generate-tokens-abc"


def test_response_shapes():
    response = GenerateResponse(request_id=response_id("r"), model="m",
                                choices=[GenerateChoice(token_ids=[1, 2], finish_reason="length")],
                                usage={"prompt_tokens": 5, "completion_tokens": 2},
                                kv_transfer_params={"handle": "x"})
    body = json.loads(response.model_dump_json())
    assert set(body) == {"request_id", "model", "created", "choices", "usage", "kv_transfer_params",
                         "ec_transfer_params", "output_mode", "prompt_token_ids", "mm_placeholders", "metrics",
                         "prompt_logprobs"}
    assert body["output_mode"] == "tokens"  # vLLM's discriminator (GenerateTokensResponse)
    assert body["choices"] == [{"index": 0, "token_ids": [1, 2], "finish_reason": "length", "logprobs": None,
                                "stop_reason": None, "weight_versions": None}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert parse_model(GenerateResponse, response.model_dump_json()) == response
    with pytest.raises(InvalidRequest, match="finish_reason: must be 'stop', 'length', 'abort' or 'error'"):
        parse_model(GenerateChoice, {"finish_reason": "eos"})


def test_stream_chunk_has_no_transfer_params():
    chunk = GenerateStreamChunk(request_id="generate-tokens-r", choices=[GenerateChoice(token_ids=[3])])
    body = json.loads(chunk.model_dump_json())
    assert "kv_transfer_params" not in body and body["usage"] is None
    usage_only = GenerateStreamChunk(request_id="x", usage={"prompt_tokens": 1, "completion_tokens": 1})
    assert usage_only.choices == [] and usage_only.usage.total_tokens == 2


def test_abort_request():
    assert parse_model(AbortRequest, {"request_ids": ["a", "b"]}).request_ids == ["a", "b"]
    with pytest.raises(InvalidRequest, match="request_ids: field required"):
        parse_model(AbortRequest, {})


def test_output_mode_text_needs_detokenize_as_in_vllm():
    assert parse_model(GenerateRequest, _request(output_mode="text")).output_mode == "text"
    message = _error(_request(output_mode="text", sampling_params={"detokenize": False}))
    assert "output_mode='text' requires sampling_params.detokenize to be true" in message
    assert parse_model(GenerateRequest, _request(sampling_params={"detokenize": False})).output_mode == "tokens"
    assert "output_mode" in _error(_request(output_mode="words"))
