"""`epd bench` against a real cluster: two runs in a row measure the encoder-cache hit ratio they
should (each run sends fresh images unless given a seed), and the measured ratio equals the ideal."""

from __future__ import annotations

import json

import pytest

from services.runtime.cli import main as epd_main


def _run(cluster, out, *extra: str) -> tuple[float, float, int]:
    encode = cluster.http_urls("encode")[0]
    assert epd_main(["bench", cluster.url, "--num-requests", "6", "--concurrency", "1", "--image-pool", "2",
                     "--image-sizes", "56x56", "--input-len", "8", "--output-len", "2", "--metrics-url", cluster.url,
                     "--metrics-url", encode, "--output", str(out), "--no-progress", *extra]) == 0
    doc = json.loads(out.read_text())
    summary = doc["levels"][0]["results"]["A"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    return summary["encoder_cache"]["hit_ratio"], summary["images"]["ideal_hit_ratio"], doc["config"]["seed"]


def test_two_bench_runs_give_the_same_ideal_and_measured_hit_ratio(shm_cluster, tmp_path):
    first = _run(shm_cluster, tmp_path / "first.json")
    second = _run(shm_cluster, tmp_path / "second.json")
    assert first[:2] == second[:2] == pytest.approx((4 / 6, 4 / 6), abs=1e-12)   # 2 distinct in 6: 4 hits, each run
    assert first[2] != second[2]
    repeat = _run(shm_cluster, tmp_path / "repeat.json", "--seed", str(second[2]))
    assert repeat[:2] == pytest.approx((1.0, 4 / 6), abs=1e-12)   # the same seed again: all its images are cached
