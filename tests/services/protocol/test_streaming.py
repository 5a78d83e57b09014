from __future__ import annotations

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateChoice, GenerateStreamChunk
from services.protocol.streaming import SSE_DONE, sse_error, sse_event
from tests.support.sse import parse_sse_data


def test_event_framing_round_trip():
    choices = [GenerateChoice(token_ids=[4])]
    chunk = GenerateStreamChunk(request_id="generate-tokens-r", created=1, choices=choices)
    event = sse_event(chunk)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and b"\n" not in event[:-2]
    assert GenerateStreamChunk.model_validate(parse_sse_data(event)) == chunk
    assert SSE_DONE == b"data: [DONE]\n\n" and parse_sse_data(SSE_DONE) is None
    assert parse_sse_data("") is None and parse_sse_data(": keep-alive") is None


def test_error_event():
    event = sse_error(InvalidRequest("bad"))
    assert parse_sse_data(event) == {"error": {"message": "bad", "type": "invalid_request_error",
                                               "code": "invalid_request"}}


def test_dict_payload_refuses_nan():
    with pytest.raises(ValueError):
        sse_event({"x": float("nan")})
