"""--compare: two endpoints alternately, same requests, figures as ratios."""

from __future__ import annotations

import pytest

from services.bench import BenchConfig, Endpoint, LoadConfig, run_bench
from services.bench.compare import ratios
from tests.services.bench.conftest import bench, summary, text_workload


def test_compare_reports_ratios_of_known_delays(fake):
    # Delays long against the client's own overhead (a few ms, tens on a loaded box), so the ratio stays near 2.
    fast, slow = fake("ttft=0.1,itl=0.005"), fake("ttft=0.2,itl=0.005")
    outcome, doc = bench([fast.url, slow.url], workload=text_workload(output_len=4), num_requests=16,
                         concurrency=2)
    level = doc["levels"][0]
    assert summary(doc, "A")["completed"] == summary(doc, "B")["completed"] == 16
    rows = {r["figure"]: r for r in level["ratios"]}
    assert 1.5 < rows["ttft_ms.p50"]["b_over_a"] < 2.1
    assert rows["ttft_ms.p50"]["a_over_b"] == pytest.approx(1 / rows["ttft_ms.p50"]["b_over_a"])
    assert rows["request_throughput"]["a_over_b"] is None and rows["request_throughput"]["b_over_a"] < 1
    # both saw byte-identical requests, alternating A B / B A per round
    assert sorted(fast.stats()["bodies"]) == sorted(slow.stats()["bodies"])
    assert len(set(fast.stats()["bodies"])) == 16
    assert outcome.levels[0].rounds == [["A", "B"]]  # 16 requests fit one automatic round


def test_rounds_alternate_the_order(fake):
    a, b = fake(), fake()
    config = BenchConfig((Endpoint(a.url, label="A"), Endpoint(b.url, label="B")), text_workload(output_len=2),
                         LoadConfig(num_requests=10), round_size=4, show_progress=False)
    outcome = run_bench(config)
    assert outcome.levels[0].rounds == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert [len(s.results) for s in outcome.levels[0].sides.values()] == [10, 10]


def test_ratio_rows_handle_missing_and_zero():
    a = {"request_throughput": 10.0, "failed": 0, "ttft_ms": {"p50": 20.0}}
    b = {"request_throughput": 30.0, "failed": 2, "ttft_ms": {"p50": 10.0}}
    rows = {r["figure"]: r for r in ratios(a, b)}
    assert rows["request_throughput"]["b_over_a"] == 3.0
    assert rows["ttft_ms.p50"]["a_over_b"] == 2.0
    assert rows["failed"]["b_over_a"] is None
    assert "tpot_ms.p50" not in rows
