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


def test_settle_waits_while_the_cpus_are_busy_and_not_once_they_are_quiet():
    import asyncio
    import os
    import subprocess
    import sys

    from services.bench.quiet import wait_quiet

    # One spinning process per usable core: the machine is never quiet, so the wait runs to its limit.
    spinners = [subprocess.Popen([sys.executable, "-c", "print('go', flush=True)\nwhile True: pass"],
                                 stdout=subprocess.PIPE, text=True)
                for _ in range(len(os.sched_getaffinity(0)))]
    try:
        assert all(spinner.stdout.readline() == "go\n" for spinner in spinners)   # all of them spinning now
        assert asyncio.run(wait_quiet(0.6)) >= 0.6
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(10)
            spinner.stdout.close()
    # Quiet again: the first window that is mostly idle ends the wait (half idle: other tests' servers may tick).
    assert asyncio.run(wait_quiet(5.0, idle_fraction=0.5)) < 2.0
    assert asyncio.run(wait_quiet(0.0)) == 0.0


def test_compare_with_settle_reports_the_wait_and_refuses_a_negative_one(fake):
    from services.bench import BenchError
    from services.bench.report import to_json

    a, b = fake(), fake()
    endpoints = (Endpoint(a.url, label="A"), Endpoint(b.url, label="B"))
    config = BenchConfig(endpoints, text_workload(output_len=2), LoadConfig(num_requests=4), round_size=2,
                         show_progress=False, settle_s=0.5)
    outcome = run_bench(config)
    doc = to_json(outcome)
    assert doc["config"]["settle_s"] == 0.5
    level = doc["levels"][0]
    assert level["rounds"] == 2 and 0 <= level["settle_s"] <= 4 * 0.5 + 0.5   # four sides' parts, each <= 0.5 s
    assert [len(s.results) for s in outcome.levels[0].sides.values()] == [4, 4]
    with pytest.raises(BenchError, match="--settle-s must be >= 0"):
        BenchConfig(endpoints, settle_s=-1.0)
