"""Admission by the SLO targets (coordinator/slo_gate.py): at overload the coordinator answers 429 with
Retry-After at once, and the requests it admitted complete with their exact tokens."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from coordinator.slo_gate import MIN_TOKENS
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


def test_while_a_stream_decodes_past_the_tpot_target_a_new_request_gets_429_then_is_admitted(demo_model_path):
    # a 10 us TPOT target: once a stream has sent MIN_TOKENS tokens after its first, its TPOT is past it, so a
    # request arriving while it decodes is refused (tpot_slo) at once; once it has ended, the same request is
    # admitted
    import json

    cluster = start_cluster("--instance-id", "tpot" + uuid.uuid4().hex[:6], "--tpot-slo-ms", "0.01",
                            "--ec-capacity-mb", "16", "--kv-capacity-mb", "16")
    long = chat("Describe this image.", [noise_image(224, 224, 6)], max_tokens=48, temperature=0,
                ignore_eos=True, stream=True)
    body = chat("Describe this image.", [noise_image(224, 224, 5)], max_tokens=8, temperature=0,
                return_token_ids=True)
    try:
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions", json=long) as stream:
                assert stream.status_code == 200
                deltas = 0
                lines = stream.iter_lines()
                for line in lines:
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        deltas += 1
                        if deltas == MIN_TOKENS + 2:
                            break
                began = time.monotonic()
                refused = client.post("/v1/chat/completions", json=body)
                took = time.monotonic() - began
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "tpot_slo"
                assert "--tpot-slo-ms" in refused.json()["error"]["message"]
                assert took < 5.0   # refused at once, before any work
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]"
            # nothing decodes now; the coordinator ends the request just after its last byte, so the first try
            # may still find it decoding (a bounded retry, as a client honouring Retry-After would)
            late = 0
            for _ in range(20):
                admitted = client.post("/v1/chat/completions", json=body)
                if admitted.status_code != 429:
                    break
                late += 1
                time.sleep(0.1)
            assert admitted.status_code == 200, admitted.text
            assert len(admitted.json()["choices"][0]["token_ids"]) == 8
            assert late <= 2
        refusals = metric_value(httpx.get(cluster.url + "/metrics", timeout=10).text,
                                "epd_coordinator_rejected_requests_total", 'reason="tpot_slo"')
        assert refusals == 1 + late
    finally:
        assert cluster.stop() == 0
