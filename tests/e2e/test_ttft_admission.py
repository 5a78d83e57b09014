"""Admission by the TTFT target (coordinator/ttft_gate.py): at overload the coordinator answers 429 with
Retry-After at once, and the requests it admitted complete with their exact tokens."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.cluster import metric_value, start_cluster
from tests.support.images import chat, noise_image


def test_past_the_target_new_requests_get_429_and_admitted_ones_complete(demo_model_path):
    # a 1 ms target: once one request has been measured, any request that finds another waiting for its
    # first token would miss it (a request that finds none waiting is always admitted)
    cluster = start_cluster("--instance-id", "slo" + uuid.uuid4().hex[:6], "--ttft-slo-ms", "1",
                            "--ec-capacity-mb", "16", "--kv-capacity-mb", "16")
    body = chat("Describe this image.", [noise_image(224, 224, 5)], max_tokens=8, temperature=0,
                return_token_ids=True)
    try:
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            first = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            tokens = first.json()["choices"][0]["token_ids"]
            assert len(tokens) == 8

            def ask(_: int) -> tuple[int, str, dict, float]:
                began = time.monotonic()
                reply = client.post("/v1/chat/completions", json=body)
                return reply.status_code, reply.headers.get("retry-after", ""), reply.json(), time.monotonic() - began

            with ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(ask, range(8)))
        statuses = sorted(status for status, *_ in replies)
        assert set(statuses) == {200, 429}, statuses
        for status, retry_after, answer, took in replies:
            if status == 200:
                assert answer["choices"][0]["token_ids"] == tokens
            else:
                assert retry_after.isdigit() and int(retry_after) >= 1
                assert answer["error"]["code"] == "ttft_slo", answer
                assert "--ttft-slo-ms" in answer["error"]["message"]
                assert took < 5.0   # refused at once, before any work
        refused = metric_value(httpx.get(cluster.url + "/metrics", timeout=10).text,
                               "epd_coordinator_rejected_requests_total", 'reason="ttft_slo"')
        assert refused == statuses.count(429)
    finally:
        assert cluster.stop() == 0
