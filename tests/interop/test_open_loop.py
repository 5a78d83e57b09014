"""benchmarks/open_loop.py --quick end to end: `vllm bench serve` (from the vLLM peer venv this suite installs)
against two epd clusters, Poisson arrivals; its figures from the JSON it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.common import RESULTS_ENV, ROOT
from benchmarks.peers import vllm_env


def test_quick_runs_vllm_bench_serve_against_two_epd_clusters(tmp_path):
    vllm_env.ensure_venv()   # the interop suite's peer venv (tests/interop/conftest.py sets EPD_VLLM_VENV)
    env = {**os.environ, "PYTHONPATH": str(ROOT), RESULTS_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.open_loop", "--quick"], cwd=ROOT, env=env,
                          timeout=560, capture_output=True, text=True)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    doc = json.loads((tmp_path / "open_loop_quick.json").read_text())
    assert [(r["side"], r["rate"]) for r in doc["runs"]] == [("A", 2.0), ("B", 2.0)]
    assert [r["seed"] for r in doc["runs"]] == [0, 0]   # both sides of one rate: the same requests
    for run in doc["runs"]:
        result = run["result"]
        assert result["completed"] == 6 and result["failed"] == 0, result
        assert result["total_output_tokens"] == 6 * 8          # ignore_eos: every request its 8 tokens
        assert result["median_ttft_ms"] > 0 and result["request_goodput"] is not None
        starts, ttfts = result["requests"]["start_s"], result["requests"]["ttft_ms"]   # each request, in order sent
        assert len(starts) == len(ttfts) == 6 and starts[0] == 0.0 and starts == sorted(starts)
        assert all(ttft is not None and ttft > 0 for ttft in ttfts)
        assert "ttfts" not in result and "start_times" not in result
    assert len(doc["figures"]) == 4 and all(f["value"] is not None and f["value"] > 0 for f in doc["figures"])


def test_stages_quick_reads_where_each_sides_time_goes(tmp_path):
    vllm_env.ensure_venv()
    env = {**os.environ, "PYTHONPATH": str(ROOT), RESULTS_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.open_loop_stages", "--quick"], cwd=ROOT, env=env,
                          timeout=560, capture_output=True, text=True)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    doc = json.loads((tmp_path / "open_loop_stages.json").read_text())
    assert [s["label"] for s in doc["sides"]] == ["this tree", "epd@self"]
    for side in doc["sides"]:
        assert side["bench"]["completed"] == 6 and side["bench"]["failed"] == 0, side["bench"]
        steps = side["coordinator_stage_ms"]
        assert all(steps[step] is not None and steps[step] > 0 for step in ("render", "encode", "prefill")), steps
        assert side["compute_ms"]["encode"] > 0 and side["compute_ms"]["prefill"] > 0
        assert side["decode_yield_s_per_s"] >= 0
        assert 0 < side["busy"]["busy_fraction"]["prefill"] < 1
        assert steps["first token (TTFT)"] >= steps["prefill"]
    assert [f["name"].split(",")[0] for f in doc["figures"]] == ["TTFT p50", "TTFT p99", "TPOT p50"]
    assert "| coordinator: encode |" in proc.stdout
