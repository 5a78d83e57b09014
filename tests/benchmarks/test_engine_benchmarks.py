"""Issue 10's benchmark scripts: their --quick runs measure what they claim, the overlap arithmetic and
the generated targets table are right.

Both --quick runs measure the package's tiny cluster (tests/benchmarks/conftest.py), started as each
script would start its own (same model, flags and activity log), through their --epd-url: one cluster start
instead of two.  Each run waits until the cluster is idle first, and the overlap figures count only spans
inside their own window.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import engine_targets
from benchmarks.common import RESULTS_ENV, ROOT, Figure, write_json
from benchmarks.procs import metric_sum
from benchmarks.stage_overlap import STAGES, summary, union

S = 1_000_000_000


def _wait_idle(server, timeout: float = 120.0) -> None:
    """No request in the coordinator or inside any role (an earlier run's cancelled streams are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = metric_sum(server.metrics(), "epd_coordinator_inflight_requests") + sum(
            metric_sum(server.metrics(role, index), "epd_role_queue_depth")
            for role, urls in server.roles.items() for index in range(len(urls)))
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"{busy:g} requests still running after {timeout:g} s"
        time.sleep(0.1)


def _run(module: str, results, *args: str, timeout: float = 400) -> None:
    """Run a script's --quick mode; past the deadline it gets SIGTERM first, so it stops its servers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), RESULTS_ENV: str(results)}
    proc = subprocess.Popen([sys.executable, "-m", module, "--quick", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{module} --quick took more than {timeout} s:\n{err[-3000:]}")
    assert proc.returncode == 0, f"{module} failed:\n{out[-3000:]}\n{err[-5000:]}"


def test_union_clips_and_merges():
    assert union([(5, 8), (0, 3), (2, 4), (9, 20)], 1, 10) == [(1, 4), (5, 8), (9, 10)]


def test_summary_counts_time_with_several_stages_busy():
    spans = {"render": [(0, 2 * S)], "encode": [(1 * S, 3 * S)], "prefill": [(1 * S, 2 * S)]}
    result = summary(spans, 0, 4 * S)
    assert result["busy_fraction"] == {"render": 0.5, "encode": 0.5, "prefill": 0.25, "decode_step": 0.0}
    assert result["stages_busy_fraction"] == {"0": 0.25, "1": 0.5, "2": 0.0, "3": 0.25, "4": 0.0}
    assert result["overlap_of_busy"] == pytest.approx(1 / 3)


@pytest.mark.timeout(480)
def test_stage_overlap_quick_logs_every_stage(tmp_path, tiny_cluster):
    server, folder = tiny_cluster
    _wait_idle(server)
    _run("benchmarks.stage_overlap", tmp_path, "--epd-url", server.url, "--activity-dir", str(folder))
    result = json.loads((tmp_path / "stage_overlap_quick.json").read_text())
    assert result["failed"] == 0 and all(result["summary"]["spans"].get(stage, 0) > 0 for stage in STAGES)
    assert all(result["summary"]["busy_fraction"][stage] > 0 for stage in STAGES)
    assert (tmp_path / "stage_overlap_c16.png").stat().st_size > 1000


@pytest.mark.timeout(480)
def test_tpot_under_prefill_quick_measures_both_windows(tmp_path, tiny_cluster):
    server, _ = tiny_cluster
    _wait_idle(server)
    _run("benchmarks.tpot_under_prefill", tmp_path, "--epd-url", server.url)
    doc = json.loads((tmp_path / "tpot_under_prefill_quick.json").read_text())
    [figure] = doc["figures"]
    assert figure["value"] is not None and figure["value"] > 0
    assert doc["rounds"][0]["long_prompt_tokens"] == 1024  # the long prompt is exactly that long
    assert len(doc["rounds"][0]["with_ms"]) == len(doc["rounds"][0]["without_ms"]) == 8
    first = doc["rounds"][0]   # "without" is the mean of the windows before and after the long prompt
    assert len(first["before_ms"]) == len(first["after_ms"]) == 8
    assert first["without_ms"] == [(b + a) / 2 for b, a in zip(first["before_ms"], first["after_ms"], strict=True)]


def test_targets_table_says_how_far_a_target_is_missed(tmp_path):
    write_json({"figures": [Figure("decode TPOT p50 while a 4096-token prompt prefills beside 8 streams", 1.56,
                                   1.3, "le", note="78 vs 50 ms")],
                "machine": {"time": "t0", "loadavg_at_start": [0.5, 0.4, 0.3]}}, tmp_path / "tpot_under_prefill.json")
    write_json({"figures": [Figure("output tok/s, c16, one 224x224 image, medium model, epd / vLLM CPU", 1.2)]},
               tmp_path / "vs_vllm.json")
    page = tmp_path / "page.md"
    page.write_text("# t\n")
    engine_targets.write_table(tmp_path, page)
    lines = {line.split(" | ")[0]: line for line in page.read_text().splitlines() if line.startswith("| ")}
    assert "| 1.56x | MISSED by 20% | 78 vs 50 ms |" in lines["| decode TPOT p50 while a 4k-token prompt prefills "
                                                            "beside 8 streams, vs without"]
    assert "t0 (0.5, 0.4, 0.3)" in lines["| decode TPOT p50 while a 4k-token prompt prefills beside 8 streams, "
                                         "vs without"]
    assert "| 1.20x | met |" in lines["| output tok/s, medium, one image, c=16, epd / vLLM CPU (stretch 1.5x)"]
    assert "not measured" in lines["| TTFT p50, medium, one image, c=1, epd / vLLM CPU"]


def test_fused_mlp_quick_times_both_sides_and_they_agree():
    import math

    from benchmarks import fused_mlp

    figures = fused_mlp.measure("tiny", rounds=2)
    assert [f.name.split(",")[0] for f in figures] == ["vision forward", "decoder stack"]
    for f in figures:
        assert math.isfinite(f.value) and f.value > 0, f.name
        assert "outputs differ by" in f.note


def test_omp_team_and_epd_dtype_flags_are_epd_serve_flags():
    """What each side of the two benchmarks runs, as `epd serve` parses it (their one harness, omp_team.run,
    runs two real clusters in test_epd_dtype_quick_runs_bfloat16_beside_float32)."""
    import shlex

    from benchmarks import epd_dtype, omp_team
    from services.config import from_args
    from services.runtime.cli import build_parser

    def serve(flags: str):
        return from_args(build_parser().parse_args(["serve", *shlex.split(flags)]))

    assert (serve("").cpu.single_omp_team, serve(omp_team.DEFAULT_B).cpu.single_omp_team) == ("on", "off")
    dtypes = (serve(epd_dtype.A_FLAGS).checkpoint.dtype, serve(epd_dtype.B_FLAGS).checkpoint.dtype)
    assert dtypes == ("bfloat16", "float32")


def test_epd_dtype_quick_runs_bfloat16_beside_float32():
    import math

    from benchmarks import epd_dtype

    figures, doc = epd_dtype.run(quick=True, levels=((1, 1), (2, 2)))   # omp_team.run, both clusters
    assert (doc["a_flags"], doc["b_flags"]) == ("--dtype bfloat16", "--dtype float32")
    assert [f.name.split(",")[0] for f in figures] == ["TTFT p50", "output tok/s", "TPOT p50"]
    for f in figures:
        assert math.isfinite(f.value) and f.value > 0 and "failed 0/0" in f.note, f.name


@pytest.mark.timeout(120)
def test_decode_beside_hogs_alternates_windows_and_leaves_no_neighbour(tiny_cluster, monkeypatch):
    """benchmarks.decode_beside_hogs against the shared tiny cluster, one neighbour kind and short windows: a ratio
    per neighbour, each beside-window paired with the alone-windows around it, and every neighbour it started
    (at the long prompt's priority: niceness 19) gone afterwards."""
    import asyncio

    from benchmarks import decode_beside_hogs

    server, _ = tiny_cluster
    _wait_idle(server)
    started: list[subprocess.Popen] = []
    real_start = decode_beside_hogs._start

    def start(name: str) -> list[subprocess.Popen]:
        processes = real_start(name)
        time.sleep(0.5)   # the neighbour has set its priority
        assert all(os.getpriority(os.PRIO_PROCESS, p.pid) == 19 for p in processes)
        started.extend(processes)
        return processes

    monkeypatch.setattr(decode_beside_hogs, "NEIGHBOURS", {"spin": (1, "while True:\n    pass\n")})
    monkeypatch.setattr(decode_beside_hogs, "SETTLE_S", 0.2)
    monkeypatch.setattr(decode_beside_hogs, "_start", start)
    samples = asyncio.run(decode_beside_hogs.measure(server.url, server.model_id(), rounds=2, window_s=0.5))
    assert list(samples) == ["spin"] and len(samples["spin"]) == 2 and len(started) == 2
    assert all(s["beside_ms"] > 0 and s["alone_ms"] > 0 for s in samples["spin"])
    [figure] = decode_beside_hogs.figures_of(samples)
    ratios = [s["beside_ms"] / s["alone_ms"] for s in samples["spin"]]
    assert figure.value == pytest.approx(sum(ratios) / 2)   # the median of two
    assert all(p.poll() is not None for p in started)   # killed and reaped


def test_int8_screen_bounds_keep_the_true_argmax_and_the_stage_keeps_what_its_bound_keeps():
    """benchmarks.int8_screen's two bounds, recomputed in float64 from the product stage's int8 copy: neither
    (one eps per row, one per column) ever drops the float32 head's argmax column, the per-column one keeps
    fewer, and the stage's own kernel keeps at least the per-column set (it rounds outward) and answers the
    float32 token: the figures the script prints rest on these."""
    import torch

    from benchmarks import int8_screen

    torch.manual_seed(5)
    weight = torch.randn(4096, 256) * 0.1
    weight[7, :8] = 3.0                              # an outlier column: a coarse scale for that column
    try:
        head = int8_screen.Int8Head(weight)
    except OSError as exc:
        pytest.skip(f"no AVX512-VNNI build here: {exc}")
    x = torch.randn(256, 256) * 2
    per_row, per_column = head.kept(x)
    assert (per_column <= per_row).all() and per_column.sum(1).min() >= 1   # per column is the tighter bound
    true = (x.double() @ weight.double().T).argmax(1)
    assert per_row[range(256), true].all() and per_column[range(256), true].all()
    tokens, counts = head.argmax(x)
    full = head.head(x).max(dim=1).indices
    assert torch.equal(tokens[tokens >= 0], full[tokens >= 0]) and (tokens >= 0).sum() >= 250
    decided = tokens >= 0
    assert (counts[decided] >= per_column.sum(1)[decided]).all()
    assert (counts[decided] <= per_column.sum(1)[decided] + 2).all()
    head.err_w, head.norm_w = head.err_w * 0, head.norm_w * 0     # the negative control: no bound at all
    assert not head.kept(x)[1][range(256), true].all()           # drops some row's true argmax (int8 alone errs)


def test_prefill_kernels_quick_times_each_kernel_and_the_same_first_token(tmp_path):
    """benchmarks.prefill_kernels --quick: every kernel's figure is there with both sides timed, and the prefill
    with the kernels answers the same first token as without (the script exits 1 otherwise)."""
    _run("benchmarks.prefill_kernels", tmp_path, timeout=300)
    figures = {f["name"]: f for f in json.loads((tmp_path / "prefill_kernels.json").read_text())["figures"]}
    names = " | ".join(figures)
    for part in ("causal attention, 117 keys", "causal attention, 200 keys",
                 "patch embedding", "prefill of a 117-token prompt, tiny model"):
        assert part in names
    for figure in figures.values():
        assert figure["detail"]["a_ms"] > 0 and figure["detail"]["b_ms"] > 0 and figure["value"] > 0
    prefill = next(f for name, f in figures.items() if name.startswith("prefill"))
    assert prefill["detail"]["same_first_token"] is True
