"""The one answer builder: the same deltas give the generate, chat and completion shapes, whole and streamed."""

from __future__ import annotations

import asyncio
import json

from services.protocol.answers import GenerateAnswer, OpenAIAnswer, OutputDelta
from services.protocol.errors import Unavailable
from services.protocol.generate import StreamOptions
from services.protocol.streaming import parse_sse_data

DELTAS = [OutputDelta([5], "Hel"), OutputDelta([6, 7], "lo"), OutputDelta([8], "!", "stop", 8)]


async def _source(deltas, fail: Exception | None = None):
    for delta in deltas:
        yield delta
    if fail is not None:
        raise fail


def _frames(builder, deltas, fail=None) -> list:
    async def run():
        return [parse_sse_data(f) or f async for f in builder.sse(_source(deltas, fail))]

    return asyncio.run(run())


def test_chat_collect():
    body = asyncio.run(OpenAIAnswer("chat", "chatcmpl-x", "m", 7, prompt_tokens=3).collect(_source(DELTAS)))
    assert body == {"id": "chatcmpl-x", "object": "chat.completion", "created": 7, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                                 "finish_reason": "stop", "logprobs": None, "stop_reason": 8}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_completion_collect_with_token_ids():
    builder = OpenAIAnswer("completion", "cmpl-x", "m", 7, prompt_tokens=2, prompt_token_ids=[1, 2])
    body = asyncio.run(builder.collect(_source(DELTAS[:2])))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"  # ended without a reason: the budget ran out
    assert body["choices"][0]["token_ids"] == [5, 6, 7] and body["prompt_token_ids"] == [1, 2]


def test_chat_stream_role_deltas_finish_usage_done():
    events = _frames(OpenAIAnswer("chat", "chatcmpl-x", "m", 7, prompt_tokens=3, include_usage=True), DELTAS)
    assert events[-1] == b"data: [DONE]\n\n"
    assert [e["choices"][0]["delta"] for e in events[:4]] == \
        [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {"content": "!"}]
    assert [e["choices"][0]["finish_reason"] for e in events[:4]] == [None, None, None, "stop"]
    assert all(e["usage"] is None for e in events[:4])
    assert events[4]["choices"] == [] and events[4]["usage"]["completion_tokens"] == 4


def test_stream_without_include_usage_has_no_usage_key():
    events = _frames(OpenAIAnswer("completion", "cmpl-x", "m", 7), DELTAS)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["Hel", "lo", "!"]
    assert all("usage" not in e for e in events[:-1])


def test_a_failure_after_the_first_byte_is_an_in_stream_error():
    events = _frames(OpenAIAnswer("chat", "chatcmpl-x", "m", 7), DELTAS[:1],
                     fail=Unavailable("decode died", code="decode_failed"))
    assert events[-2] == {"error": {"message": "decode died", "type": "service_unavailable",
                                    "code": "decode_failed"}}
    assert events[-1] == b"data: [DONE]\n\n"


def test_generate_collect_and_stream():
    builder = GenerateAnswer("generate-tokens-x", "m", 3, StreamOptions(continuous_usage_stats=True), created=7)
    whole = asyncio.run(builder.collect(_source(DELTAS)))
    assert json.loads(whole.model_dump_json())["choices"] == [
        {"index": 0, "token_ids": [5, 6, 7, 8], "finish_reason": "stop", "logprobs": None, "stop_reason": 8}]
    events = _frames(builder, DELTAS)
    assert [e["choices"][0]["token_ids"] for e in events[:3]] == [[5], [6, 7], [8]]
    assert [e["usage"]["completion_tokens"] for e in events[:3]] == [1, 3, 4]  # continuous usage
    assert events[3]["choices"] == [] and events[4] == b"data: [DONE]\n\n"


def test_generate_without_a_finish_is_an_abort():
    whole = asyncio.run(GenerateAnswer("g", "m", 1).collect(_source(DELTAS[:1])))
    assert whole.choices[0].finish_reason == "abort" and whole.usage.completion_tokens == 1
