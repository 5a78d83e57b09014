"""vLLM's per-request metrics: the five fields from known instants, and where the answers carry them."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.protocol.answers import OpenAIAnswer, OutputDelta
from services.protocol.request_metrics import RequestTiming

FIELDS = ["time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"]


def test_the_fields_follow_vllms_definitions():
    timing = RequestTiming(arrived=10.0, started=10.5)
    timing.saw(1, now=11.0)
    timing.saw(0, now=11.1)        # a delta with no token (held-back text) is no token
    timing.saw(2, now=11.3)
    timing.saw(1, now=11.6)
    got = timing.metrics()
    assert list(got) == FIELDS
    assert got["queue_time_ms"] == pytest.approx(500.0)
    assert got["time_to_first_token_ms"] == pytest.approx(500.0)
    assert got["generation_time_ms"] == pytest.approx(600.0)
    assert got["mean_itl_ms"] == pytest.approx(200.0)          # 600 ms over 4 - 1 gaps
    assert got["tokens_per_second"] == pytest.approx(4 / 1.1)   # 4 tokens over start -> last token


def test_missing_instants_give_none():
    none_yet = RequestTiming(arrived=1.0, started=1.25).metrics()
    assert none_yet == {"time_to_first_token_ms": None, "generation_time_ms": None, "queue_time_ms": 250.0,
                        "mean_itl_ms": None, "tokens_per_second": None}
    one = RequestTiming(arrived=1.0, started=1.0)
    one.saw(1, now=1.5)
    assert one.metrics()["mean_itl_ms"] is None and one.metrics()["generation_time_ms"] == 0.0


async def _deltas():
    for delta in (OutputDelta(token_ids=[5], text="a"), OutputDelta(token_ids=[6, 7], text="bc"),
                  OutputDelta(token_ids=[8], text="d", finish_reason="length")):
        await asyncio.sleep(0.01)
        yield delta


def test_a_whole_answer_carries_metrics_at_the_top():
    timing = RequestTiming(arrived=0.0, started=0.0)
    body = asyncio.run(OpenAIAnswer("chat", "chatcmpl-x", "m", 7, prompt_tokens=3, timing=timing).collect(_deltas()))
    assert list(body["metrics"]) == FIELDS and timing.tokens == 4
    assert body["metrics"]["generation_time_ms"] >= 15.0   # two sleeps of 10 ms between first and last token
    plain = asyncio.run(OpenAIAnswer("chat", "chatcmpl-x", "m", 7, prompt_tokens=3).collect(_deltas()))
    assert "metrics" not in plain


def _events(builder: OpenAIAnswer) -> list[dict]:
    async def run():
        return [chunk async for chunk in builder.sse(_deltas())]
    raw = b"".join(asyncio.run(run())).decode()
    return [json.loads(e.removeprefix("data: ")) for e in raw.strip().split("\n\n") if e != "data: [DONE]"]


def test_a_stream_carries_metrics_on_the_usage_chunk_only():
    events = _events(OpenAIAnswer("completion", "cmpl-x", "m", 7, prompt_tokens=3, include_usage=True,
                                  timing=RequestTiming(0.0, 0.0)))
    assert [("metrics" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert list(events[-1]["metrics"]) == FIELDS
    # as vLLM: without include_usage there is no usage chunk, so no metrics
    quiet = _events(OpenAIAnswer("completion", "cmpl-x", "m", 7, prompt_tokens=3, timing=RequestTiming(0.0, 0.0)))
    assert not any("metrics" in e for e in quiet)
