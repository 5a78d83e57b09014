from __future__ import annotations

import json

from services.protocol.errors import InvalidRequest, Overloaded
from services.protocol.openai_responses import (
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
)


def _json(model) -> dict:
    return json.loads(model.model_dump_json())


def test_chat_completion_shape():
    response = ChatCompletionResponse(model="m", choices=[ChatCompletionChoice(
        message=ChatResponseMessage(content="hi"), finish_reason="stop")],
        usage={"prompt_tokens": 3, "completion_tokens": 1})
    body = _json(response)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and body["model"] == "m"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_chat_chunk_delta_drops_unset_fields():
    first = ChatCompletionChunk(id="chatcmpl-1", model="m",
                                choices=[ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
    middle = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[ChatChunkChoice(
        delta=DeltaMessage(content="x"))])
    last = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[ChatChunkChoice(finish_reason="length")])
    assert _json(first)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _json(middle)["choices"][0] == {"index": 0, "delta": {"content": "x"}, "finish_reason": None,
                                           "logprobs": None}
    assert _json(last)["choices"][0]["delta"] == {}
    assert _json(middle)["object"] == "chat.completion.chunk"
    counts = {"prompt_tokens": 1, "completion_tokens": 2}
    usage = ChatCompletionChunk(id="chatcmpl-1", model="m", usage=counts)
    assert _json(usage)["choices"] == [] and _json(usage)["usage"]["total_tokens"] == 3


def test_completion_shapes():
    response = CompletionResponse(model="m", choices=[CompletionChoice(text="ab", finish_reason="stop"),
                                                      CompletionChoice(index=1, text="c")])
    body = _json(response)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["ab", "c"]
    chunk = _json(CompletionChunk(id="cmpl-1", model="m", choices=[CompletionChoice(text="a")]))
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "a"


def test_model_list():
    body = _json(ModelList(data=[ModelCard(id="qwen", max_model_len=4096)]))
    assert body["object"] == "list"
    card = body["data"][0]
    assert card["id"] == "qwen" and card["object"] == "model" and card["owned_by"] == "epd"
    assert card["max_model_len"] == 4096 and isinstance(card["created"], int)


def test_error_response_from_taxonomy():
    body = _json(ErrorResponse.model_validate(InvalidRequest("token_ids: must not be empty").to_body()))
    assert body["error"]["message"] == "token_ids: must not be empty"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_request"
    assert _json(ErrorResponse.model_validate(Overloaded("busy").to_body()))["error"]["type"] == "rate_limit_error"
