"""vLLM's per-request metrics through a running cluster (`--enable-per-request-metrics`, on secure_cluster)."""

from __future__ import annotations

import json
import time

import httpx

from tests.e2e.conftest import PUBLIC_KEYS
from tests.support.images import chat, noise_image

HEADERS = {"Authorization": f"Bearer {PUBLIC_KEYS[0]}"}
FIELDS = ["time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"]


def test_a_chat_answer_reports_its_own_timing(secure_cluster):
    body = {**chat("Describe.", [noise_image(56, 56, seed=41)], max_tokens=6), "ignore_eos": True}
    started = time.monotonic()
    reply = httpx.post(secure_cluster.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=60)
    wall_ms = (time.monotonic() - started) * 1000
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    metrics = answer["metrics"]
    assert list(metrics) == FIELDS and answer["usage"]["completion_tokens"] == 6
    assert 0 <= metrics["queue_time_ms"] < metrics["time_to_first_token_ms"]
    assert metrics["queue_time_ms"] + metrics["time_to_first_token_ms"] + metrics["generation_time_ms"] < wall_ms
    assert abs(metrics["mean_itl_ms"] * 5 - metrics["generation_time_ms"]) < 1e-6   # 6 tokens, 5 gaps
    span_s = (metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]) / 1000
    assert abs(metrics["tokens_per_second"] - 6 / span_s) < 1e-6 * metrics["tokens_per_second"]


def test_a_streamed_completion_reports_timing_on_its_usage_chunk(secure_cluster):
    body = {"prompt": "Count: one, two,", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", secure_cluster.url + "/v1/completions", json=body, headers=HEADERS,
                      timeout=60) as reply:
        assert reply.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert [("metrics" in e) for e in events] == [False] * (len(events) - 1) + [True]
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert list(last["metrics"]) == FIELDS and last["metrics"]["time_to_first_token_ms"] > 0
