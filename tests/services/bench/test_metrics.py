"""Figures computed from streams with known delays (fake server), goodput, failures, odd servers."""

from __future__ import annotations

import socket

import pytest

from services.bench import BenchConfig, BenchError, Endpoint, LoadConfig, Slo, run_bench
from services.bench.metrics import stats_ms
from services.bench.report import to_json
from tests.services.bench.conftest import bench, summary, text_workload

TTFT, ITL, TOKENS = 0.05, 0.01, 8
SLACK_MS = 25.0  # client, loopback and a busy 2-core machine


def _near(value, expected_ms):
    return expected_ms <= value <= expected_ms + SLACK_MS


def test_figures_match_the_scripted_delays(fake):
    server = fake(f"ttft={TTFT},itl={ITL}")
    slo = Slo(ttft_ms=200, tpot_ms=30)
    _, doc = bench([server.url], slo=slo, num_requests=12, concurrency=4)
    s = summary(doc)
    assert s["completed"] == 12 and s["failed"] == 0 and s["usage_reported"] == 12
    assert _near(s["ttft_ms"]["p50"], 50)
    assert s["tpot_ms"]["p50"] == pytest.approx(10, abs=3)
    assert s["itl_ms"]["p50"] == pytest.approx(10, abs=3) and s["itl_ms"]["n"] == 12 * (TOKENS - 1)
    assert _near(s["e2el_ms"]["p50"], 50 + 7 * 10)
    assert s["output_tokens"] == 12 * TOKENS and s["prompt_tokens"] == 12 * 16
    assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
    assert s["goodput"]["good"] == 12 and s["goodput"]["request_goodput"] == pytest.approx(s["request_throughput"])
    assert s["client"]["parse_us_per_chunk"] > 0


def test_goodput_counts_only_requests_within_every_slo(fake):
    server = fake(f"ttft={TTFT},itl={ITL}")
    _, doc = bench([server.url], slo=Slo(ttft_ms=20), num_requests=4)
    assert summary(doc)["goodput"]["good"] == 0
    _, doc = bench([server.url], slo=Slo(ttft_ms=1000, tpot_ms=5), num_requests=4)
    assert summary(doc)["goodput"]["good"] == 0
    _, doc = bench([server.url], slo=Slo(ttft_ms=1000, tpot_ms=100, e2el_ms=5000), num_requests=4)
    assert summary(doc)["goodput"]["good_fraction"] == 1.0


@pytest.mark.parametrize("code", [500, 429])
def test_failures_are_counted_with_samples(fake, code):
    server = fake(f"fail={code}:3")
    _, doc = bench([server.url], num_requests=9)
    s = summary(doc)
    assert (s["completed"], s["failed"]) == (6, 3)
    assert s["errors"][0]["count"] == 3 and s["errors"][0]["error"].startswith(f"HTTP {code}")


def test_no_done_and_empty_first_chunk(fake):
    server = fake(f"ttft={TTFT},itl={ITL},done=0,empty_first=1")
    _, doc = bench([server.url], num_requests=4, timeout_s=5)
    s = summary(doc)
    assert s["completed"] == 4
    assert _near(s["ttft_ms"]["min"], 50)  # the empty first chunk is not the first token
    assert _near(s["e2el_ms"]["p50"], 50 + 7 * 10)


def test_without_usage_tokens_are_counted_from_chunks(fake):
    server = fake("usage=0")
    _, doc = bench([server.url], workload=text_workload(output_len=5), num_requests=3)
    s = summary(doc)
    assert s["usage_reported"] == 0 and s["output_tokens"] == 15 and s["prompt_tokens"] == 3 * 16


def test_a_non_streaming_answer_still_counts(fake):
    _, doc = bench([fake("json=1,ttft=0.02").url], num_requests=2)
    s = summary(doc)
    assert s["completed"] == 2 and s["ttft_ms"]["p50"] == pytest.approx(s["e2el_ms"]["p50"])


def test_timeouts_and_refused_connections_fail_cleanly(fake):
    _, doc = bench([fake("ttft=2").url], num_requests=1, timeout_s=0.3)
    assert summary(doc)["errors"] == [{"error": "timeout", "count": 1}]
    closed = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(BenchError, match="pass --model"):
        bench([closed], num_requests=1)
    config = BenchConfig((Endpoint(closed, "m"),), text_workload(), LoadConfig(num_requests=2), show_progress=False)
    s = to_json(run_bench(config))["levels"][0]["results"]["A"]
    assert s["failed"] == 2 and s["errors"][0]["error"].startswith("ClientConnectorError")


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_stats_ms_percentiles():
    s = stats_ms([0.001 * i for i in range(1, 101)])
    assert s["n"] == 100 and s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert stats_ms([])["p50"] is None
