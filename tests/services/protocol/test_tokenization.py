from __future__ import annotations

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.parsing import parse_model
from services.protocol.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    parse_tokenize_request,
)


def test_tokenize_forms():
    plain = parse_tokenize_request(b'{"model": "m", "prompt": "hello"}')
    assert isinstance(plain, TokenizeCompletionRequest) and plain.add_special_tokens
    chat = parse_tokenize_request({"messages": [{"role": "user", "content": "hi"}],
                                   "add_generation_prompt": False})
    assert isinstance(chat, TokenizeChatRequest) and not chat.add_generation_prompt


def test_tokenize_errors():
    with pytest.raises(InvalidRequest, match="prompt: field required"):
        parse_tokenize_request({})
    with pytest.raises(InvalidRequest, match="messages: must not be empty"):
        parse_tokenize_request({"messages": []})
    with pytest.raises(InvalidRequest, match="malformed JSON body"):
        parse_tokenize_request(b"{")


def test_tokenize_response_and_detokenize():
    body = TokenizeResponse(count=2, max_model_len=4096, tokens=[1, 2]).model_dump(exclude_none=True)
    assert body == {"count": 2, "max_model_len": 4096, "tokens": [1, 2]}
    assert parse_model(DetokenizeRequest, {"tokens": [1, 2]}).tokens == [1, 2]
    with pytest.raises(InvalidRequest, match=r"tokens\[0\]: must be >= 0"):
        parse_model(DetokenizeRequest, {"tokens": [-1]})
    assert DetokenizeResponse(prompt="hi").model_dump() == {"prompt": "hi"}
