"""Decode's generate answers (api_router.py: engine events through the one answer builder) over real DecodeEvents.

The event source is a plain async generator standing in for DecodeService.decode, so the cases the
running cluster cannot produce on demand are covered: an engine error mid-stream (in-stream error event,
then [DONE]; a 500 when not streaming) and a stream that times out.
"""

from __future__ import annotations

import asyncio

import pytest

from services.decode.api_router import decode_answer, output_deltas
from services.decode.stream import DecodeEvent, StreamTimeout
from services.protocol.errors import InternalError
from services.protocol.generate import GenerateRequest
from tests.support.sse import parse_sse_data


def _request(**extra):
    return GenerateRequest.model_validate({"token_ids": [1, 2, 3], "kv_transfer_params": {
        "num_prompt_tokens": 3}, **extra})


async def _call(events, **extra):
    async def source():
        for event in events:
            if isinstance(event, Exception):
                raise event
            yield event

    iterator = source()
    first = await anext(iterator)
    return decode_answer(_request(**extra), "generate-tokens-r", "m"), output_deltas(first, iterator)


def _collect(events, **extra):
    async def run():
        answer, deltas = await _call(events, **extra)
        return await answer.collect(deltas)

    return asyncio.run(run())


def _frames(events, **extra):
    async def run():
        answer, deltas = await _call(events, **extra)
        return [frame async for frame in answer.sse(deltas)]

    return asyncio.run(run())


OK = [DecodeEvent("r", [5], "a", completion_tokens=1), DecodeEvent("r", [6, 7], "bc", completion_tokens=3),
      DecodeEvent("r", [8], "d", "stop", 8, completion_tokens=4)]


def test_collect_gives_all_tokens_finish_and_usage():
    answer = _collect(OK)
    assert answer.request_id == "generate-tokens-r"
    assert answer.choices[0].token_ids == [5, 6, 7, 8]
    assert (answer.choices[0].finish_reason, answer.choices[0].stop_reason) == ("stop", 8)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (3, 4, 7)


def test_sse_deltas_usage_and_done():
    frames = _frames(OK, stream=True, stream_options={"include_usage": True})
    assert frames[-1] == b"data: [DONE]\n\n" and all(f.endswith(b"\n\n") for f in frames)
    events = [parse_sse_data(f) for f in frames[:-1]]
    assert [e["choices"][0]["token_ids"] for e in events[:-1]] == [[5], [6, 7], [8]]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "stop"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert all(e["usage"] is None for e in events[:-1])


def test_error_event_mid_stream_is_an_in_stream_error():
    failing = [OK[0], DecodeEvent("r", [], "", "error", error="forward failed", completion_tokens=1)]
    frames = _frames(failing, stream=True, stream_options={"include_usage": True})
    assert parse_sse_data(frames[0])["choices"][0]["token_ids"] == [5]
    assert parse_sse_data(frames[1]) == {"error": {"message": "forward failed", "type": "internal_error",
                                                   "code": "decode_error"}}
    assert frames[2:] == [b"data: [DONE]\n\n"]
    with pytest.raises(InternalError, match="forward failed"):
        _collect(failing)


def test_exception_mid_stream_is_an_in_stream_error():
    frames = _frames([OK[0], StreamTimeout("no decode event for r within 30s")], stream=True)
    error = parse_sse_data(frames[1])["error"]
    assert error["type"] == "internal_error" and "no decode event" not in error["message"]  # internals not leaked
    assert frames[-1] == b"data: [DONE]\n\n"
