"""The load gauges llm-d's scheduler reads, scraped from running roles: vLLM's names, type, help and labels.

Idle roles report 0 running, 0 waiting, 0 KV in use; a decode with a request in flight reports it
running and its KV blocks (reserved for the whole answer) as the pool fraction epd's own gauge shows.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.images import chat

NAMES = {"vllm:num_requests_running": "Number of requests in model execution batches.",
         "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
         "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage."}


def scrape(url: str) -> dict[str, tuple[str, str, list]]:
    """name -> (type, help, [(labels, value)]) of every family in one scrape."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: (f.type, f.documentation, [(s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def model(shm_cluster):
    return httpx.get(shm_cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def settled(url: str, deadline_s: float = 15.0) -> dict[str, tuple[str, str, list]]:
    """A scrape once no request is left running or waiting (an earlier test's aborted stream may still
    be winding down), or the last one at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        families = scrape(url)
        busy = [families[n][2][0][1] for n in ("vllm:num_requests_running", "vllm:num_requests_waiting")]
        if busy == [0.0, 0.0] or time.monotonic() > end:
            return families
        time.sleep(0.1)


@pytest.mark.parametrize("role", ["encode", "prefill", "decode"])
def test_idle_role_exports_vllm_load_gauges(shm_cluster, model, role):
    families = settled(shm_cluster.http_urls(role)[0])
    for name, doc in NAMES.items():
        assert families[name] == ("gauge", doc, [({"model_name": model, "engine": "0"}, 0.0)]), (role, name)


def test_decode_in_flight_is_running_with_its_kv(shm_cluster, model):
    settled(shm_cluster.http_urls("decode")[0])
    body = {"model": model, **chat("Count slowly.", max_tokens=1500, temperature=0, ignore_eos=True, stream=True)}
    with httpx.stream("POST", shm_cluster.url + "/v1/chat/completions", json=body, timeout=120) as reply:
        lines = reply.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        families = scrape(shm_cluster.http_urls("decode")[0])
    running, waiting, usage = (families[n][2][0][1] for n in NAMES)
    assert (running, waiting) == (1.0, 0.0)
    total = families["epd_decode_kv_blocks"][2][0][1]
    assert 0 < usage < 1 and usage * total == pytest.approx(round(usage * total))
    assert usage == families["epd_decode_kv_usage_ratio"][2][0][1]
