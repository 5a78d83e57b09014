from __future__ import annotations

import pytest

from services.protocol.derender import ChatDerenderRequest, CompletionDerenderRequest
from services.protocol.errors import InvalidRequest
from services.protocol.parsing import parse_model

RESPONSE = {"request_id": "generate-tokens-r", "model": "m", "created": 1,
            "choices": [{"index": 0, "token_ids": [5, 6], "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}


def test_chat_derender_body():
    body = {"model": "m", "generate_response": RESPONSE, "prompt_tokens": 4,
            "chat_request": {"messages": [{"role": "user", "content": "hi"}], "stop": "x"}}
    request = parse_model(ChatDerenderRequest, body)
    assert request.generate_response.choices[0].token_ids == [5, 6]
    assert request.num_prompt_tokens == 4 and request.chat_request.stop == ["x"]
    assert parse_model(ChatDerenderRequest, {**body, "prompt_tokens": [1, 2, 3]}).num_prompt_tokens == 3


def test_completion_derender_body():
    body = {"generate_responses": [RESPONSE, RESPONSE], "prompt_tokens": [4, [1, 2]]}
    request = parse_model(CompletionDerenderRequest, body)
    assert request.num_prompt_tokens == [4, 2]
    with pytest.raises(InvalidRequest, match="prompt_tokens has 1 entries but generate_responses has 2"):
        parse_model(CompletionDerenderRequest, {**body, "prompt_tokens": [4]})
    with pytest.raises(InvalidRequest, match="generate_responses: must not be empty"):
        parse_model(CompletionDerenderRequest, {"generate_responses": [], "prompt_tokens": []})


def test_derender_errors_name_nested_fields():
    with pytest.raises(InvalidRequest, match=r"generate_response.choices\[0\].finish_reason"):
        parse_model(ChatDerenderRequest, {"generate_response": {**RESPONSE, "choices": [
            {"finish_reason": "eos"}]}, "prompt_tokens": 1})
    with pytest.raises(InvalidRequest, match="prompt_tokens: must be >= 0"):
        parse_model(ChatDerenderRequest, {"generate_response": RESPONSE, "prompt_tokens": -1})
