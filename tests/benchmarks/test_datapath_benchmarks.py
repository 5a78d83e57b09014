"""The data-path benchmarks' arithmetic and tables, on known numbers (their runs take minutes).

render_workers: the median of per-round ratios and the CPU-bound ceiling; overhead: the breakdown line
of its docs block; ttft_vs_vllm: the two image sizes it measures and its docs table.  request_trace and idle_ttft
measure the package's tiny cluster (tests/benchmarks/conftest.py).
"""

from __future__ import annotations

import pytest

from benchmarks import overhead, ttft_vs_vllm
from benchmarks.common import Figure
from benchmarks.render_workers import Round, figures


def test_figure_is_the_median_of_back_to_back_ratios_with_the_cpu_ceiling():
    one = [Round(10.0, 6.0, 1.0), Round(20.0, 6.0, 1.0), Round(40.0, 6.0, 1.0)]
    two = [Round(18.0, 6.0, 1.0), Round(30.0, 6.0, 1.0), Round(80.0, 6.0, 1.0)]  # ratios 1.8, 1.5, 2.0
    (figure,) = figures({1: one, 2: two})
    assert figure.value == pytest.approx(1.8)
    assert figure.passed is True and figure.target == 1.7
    assert figure.detail["round_ratios"] == pytest.approx([1.8, 1.5, 2.0])
    assert figure.detail["ceiling_2_idle_cores"] == pytest.approx(12.0 / 7.0)
    assert figure.detail["images_per_s_1_worker"] == 20.0 and figure.detail["images_per_s_2_workers"] == 30.0
    assert "ratio = median of per-round ratios 1.50..2.00" in figure.note
    assert "workers 6.0 ms, main process 1.0 ms, so the ceiling on 2 idle cores is 1.71x" in figure.note


def test_overhead_breakdown_line_names_every_part():
    detail = {"hop_render_ms": 2.0, "hop_encode_ms": 1.9, "hop_prefill_ms": 1.8, "coordinator_rest_ms": 4.6,
              "client_side_ms": 2.3, "transfers_and_handlers_ms": 8.2}
    assert overhead.breakdown_text(detail) == (
        "Where the overhead sits (p50 ms, each on its own): render hop 2.00; encode hop 1.90; prefill hop 1.80; "
        "coordinator outside the three calls (decode open included) 4.60; client side (HTTP in and out) 2.30; "
        "in-role transfers 8.20.")
    assert overhead.TARGET_MS == 5.0


def test_ttft_vs_vllm_measures_both_sizes_at_c1_and_tabulates_them():
    runs = ttft_vs_vllm.setups(12)
    assert [r.image_size for r in runs] == [(224, 224), (1024, 768)]
    assert all(r.levels == ((1, 12),) and r.model == "hd32" and r.output_len == 8 for r in runs)
    where = {"time": "t", "cpus": 2, "loadavg_at_start": [1.0, 2.0, 3.0]}
    table = ttft_vs_vllm.markdown([Figure("a", 0.9, 1.0, "le", note="45.0 vs 50.0 ms"), Figure("b", None, 1.0, "le")],
                                  where, "python -m benchmarks.ttft_vs_vllm")
    assert table.splitlines()[-2:] == ["| a | 0.90x (45.0 vs 50.0 ms) | <= 1.0x | met |", "| b | n/a | <= 1.0x | n/a |"]
    assert "load average at start [1.0, 2.0, 3.0]" in table


def test_tree_at_exports_the_version_at_a_git_ref():
    """`--compare-ref` starts a baseline cluster from this: the files exactly as committed at the ref."""
    import subprocess

    from benchmarks.common import ROOT
    from benchmarks.procs import tree_at

    tree = tree_at("HEAD")
    committed = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:services/runtime/cli.py"], check=True,
                               capture_output=True).stdout
    assert (tree / "services" / "runtime" / "cli.py").read_bytes() == committed
    assert (tree / "services" / "rpc" / "v1" / "epd_pb2.py").is_file() and not (tree / ".git").exists()
    # the baseline loads its native kernels: the loader refuses a folder others may write (it refused them all)
    from services.kernels.loader import _unsafe

    kernels = tree / "services" / "kernels"
    assert _unsafe(kernels / "loader.py") == "" and not kernels.stat().st_mode & 0o022


def test_hop_latency_measures_each_transport_of_one_hop_hot_and_after_idle():
    """The fast lane's case (docs/architecture.md cites it): gRPC over TCP, gRPC over a Unix socket and the lane,
    one real method each, every p50 in ms, and each ratio the ratio of those p50s."""
    from benchmarks import hop_latency

    figures, p50 = hop_latency.run(rounds=1, count=10, idle_ms=5.0)
    assert set(p50) == {"hot", "idle"} and all(set(v) == set(hop_latency.KINDS) for v in p50.values())
    assert all(0 < ms < 100 for case in p50.values() for ms in case.values())
    assert [f.name for f in figures] == [f"hop p50 {case}: gRPC over {over} / the fast lane"
                                         for case in ("after 5 ms idle", "hot") for over in ("a Unix socket", "TCP")]
    assert figures[0].value == p50["idle"]["grpc-unix"] / p50["idle"]["fast-lane"]


def test_request_trace_takes_the_common_path_and_medians_each_segment():
    from benchmarks.request_trace import paths, segments

    def path(sent: int, gaps: list[int], names: list[str]) -> list[tuple[int, str]]:
        at, out = sent, []
        for gap, name in zip(gaps, names, strict=True):
            at += gap
            out.append((at, name))
        return out

    names = ["a.in", "encode.compute.start", "encode.compute.end", "a.out"]
    events = path(0, [1000, 2000, 5000, 1000], names) + path(100_000, [3000, 2000, 7000, 1000], names) + \
        path(200_000, [2000, 2000, 6000, 1000], names) + path(300_000, [500, 9000], ["a.in", "a.out"])
    windows = [(0, 10_000), (100_000, 14_000 + 100_000), (200_000, 12_000 + 200_000), (300_000, 310_000)]
    result = segments(paths(sorted(events), windows))
    assert result["requests"] == 4 and result["on_path"] == 3
    assert [(r["from"], r["to"], r["median_us"], r["compute"]) for r in result["rows"]] == [
        ("client.send", "a.in", 2.0, False), ("a.in", "encode.compute.start", 2.0, False),
        ("encode.compute.start", "encode.compute.end", 6.0, True), ("encode.compute.end", "a.out", 1.0, False),
        ("a.out", "client.first_token", 1.0, False)]
    assert result["compute_us"] == 6.0 and result["other_us"] == 6.0 and result["ttft_us"] == 12.0


@pytest.mark.timeout(180)
def test_request_trace_sees_one_request_cross_every_process_in_order(tiny_cluster):
    """A real tiny cluster with the activity log on (the package's: tests/benchmarks/conftest.py): each request's
    path runs through the coordinator's steps, every role's handler, the engines' threads, the stores and the
    compute spans, in this order, one whole call per hop."""
    from benchmarks.request_trace import trace

    result = trace(*tiny_cluster, 3, warmup=2)
    order = [result["rows"][0]["from"]] + [row["to"] for row in result["rows"]]
    expected = ["client.send", "coordinator.http_in", "coordinator.render.start", "RenderChat.in", "RenderChat.out",
                "coordinator.render.end", "coordinator.encode.start", "Encode.in", "encode.engine_batch",
                "encode.compute.start", "encode.compute.end", "encode.engine_done", "encode.ec_put.start",
                "encode.ec_put.end", "Encode.out", "coordinator.encode.end", "coordinator.prefill.start", "Prefill.in",
                "prefill.ec_views.start", "prefill.ec_views.end", "prefill.engine_batch", "prefill.compute.start",
                "prefill.compute.end", "prefill.kv_put.start", "prefill.kv_put.end", "prefill.engine_done",
                "Prefill.out", "coordinator.prefill.end", "coordinator.decode.start", "Decode.in",
                "decode.kv_open.start", "decode.kv_open.end", "Decode.first", "coordinator.decode.end",
                "coordinator.first_delta", "client.first_token"]
    assert [name for name in order if name in expected] == expected
    assert result["on_path"] >= 2 and 0 < result["compute_us"] < result["ttft_us"]


@pytest.mark.timeout(180)
def test_idle_ttft_measures_each_pause_on_a_real_cluster(tiny_cluster):
    from benchmarks.idle_ttft import PAUSES_S, figures, measure

    got = measure({"A": tiny_cluster[0]}, 2, rounds=1)
    assert sorted(got["A"]) == sorted(PAUSES_S) and all(len(times) == 2 for times in got["A"].values())
    assert all(0 < t < 10_000 for times in got["A"].values() for t in times)
    rows = figures(got, "demo")
    assert [f.name for f in rows] == [f"TTFT p50 after {p:g} s idle (demo)" for p in PAUSES_S]
    both = figures({"A": got["A"], "B": got["A"]}, "HEAD")
    assert [f.value for f in both] == [1.0, 1.0, 1.0] and "A " in both[0].note and "B " in both[0].note
