"""Graceful drain: SIGTERM to `epd serve` with a stream in flight lets that stream finish.

While the coordinator drains, its readiness is 503, a new request is refused with 503
`shutting_down`, liveness still answers; then everything stops with status 0 and says what it did.
The only test with its own cluster for this: draining ends the cluster.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.support.cluster import start_cluster
from tests.support.images import chat

TOKENS = 300


def _stream(url: str, first: threading.Event, out: dict) -> None:
    body = chat("Tell me a long story.", max_tokens=TOKENS, ignore_eos=True, temperature=0, stream=True,
                stream_options={"include_usage": True})
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as reply:
        out["status"] = reply.status_code
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    first.set()
    out["events"] = events


def test_sigterm_lets_a_running_stream_finish_then_stops(demo_model_path):
    cluster = start_cluster("--shutdown-grace-s", "30", "--ec-capacity-mb", "16", "--kv-capacity-mb", "16")
    first, out = threading.Event(), {}
    streamer = threading.Thread(target=_stream, args=(cluster.url, first, out))
    try:
        streamer.start()
        assert first.wait(60), "the stream never started"
        cluster.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (ready := httpx.get(cluster.url + "/ready", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, ready.text
            time.sleep(0.05)
        assert "draining for shutdown" in ready.json()["problems"]
        assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200
        refused = httpx.post(cluster.url + "/v1/chat/completions", json=chat("hi", max_tokens=2), timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        assert streamer.is_alive(), "the stream ended before the checks: make it longer"
        streamer.join(120)
        assert cluster.process.wait(timeout=60) == 0
    finally:
        if cluster.process.poll() is None:
            cluster.process.kill()
    events = out["events"]
    assert out["status"] == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS and not any("error" in c for c in chunks)
    time.sleep(0.2)  # the output pump thread reads the last lines
    text = "".join(cluster.output)
    assert "epd serve: stopping: the coordinator refuses new requests and lets running ones finish (up to 30 s)" \
        in text
    assert "coordinator draining: not ready, refusing new requests; 1 running get up to 30 s to finish" in text
    assert "coordinator drained in" in text and "epd serve: stopped" in text
