"""benchmarks/vs_vllm_video.py without servers: its bench configuration, figures and docs table from a document."""

from __future__ import annotations

from benchmarks.vs_vllm_video import LEVELS, VsVllmVideo, bench_config, figures, markdown


def _side(completed: int, duration: float, ttft: float, hits: float | None = None) -> dict:
    cache = {"frame_groups": {"groups": 96.0, "hits": 46.0, "hit_ratio": hits}} if hits is not None else None
    return {"completed": completed, "failed": 0, "duration_s": duration, "ttft_ms": {"p50": ttft, "p99": ttft},
            "tpot_ms": {"p50": 10.0}, "e2el_ms": {"p50": 100.0}, "encoder_cache": cache}


def _doc() -> dict:
    levels = {"distinct": {"results": {"A": _side(24, 10.0, 50.0, 0.0), "B": _side(24, 12.0, 60.0)}},
              "overlap": {"results": {"A": _side(24, 6.0, 40.0, 0.479), "B": _side(24, 12.0, 60.0)}}}
    return {"levels": levels, "probe": {"prompt_tokens": {"epd": 285, "vllm": 285}, "same_text": True},
            "machine": {"time": "t", "cpus": 2, "loadavg_at_start": 1.0}}


def test_figures_are_output_token_ratios_against_their_targets():
    setup = VsVllmVideo(output_len=32)
    distinct, overlap = figures(_doc(), setup)
    assert distinct.value == 12.0 / 10.0 and distinct.target == 1.0
    assert overlap.value == 12.0 / 6.0 and overlap.target == 1.5 and "0.479" in overlap.note


def test_the_docs_table_has_one_row_per_level():
    text = markdown(_doc(), VsVllmVideo(), "python -m benchmarks.vs_vllm_video")
    rows = [line for line in text.splitlines() if line.startswith("| distinct") or line.startswith("| overlap")]
    assert len(rows) == len(LEVELS) and "1.20x" in rows[0] and "2.00x" in rows[1] and "285 prompt tokens" in text


def test_the_workload_is_one_clip_per_request_at_2_fps():
    class Server:
        url, metrics_urls = "http://a", staticmethod(lambda: ["http://a"])

    servers = type("S", (), {"epd": Server, "peer": Server, "epd_model": "m", "peer_model": "m"})()
    config = bench_config(servers, VsVllmVideo(), 0.5)
    work = config.workload
    assert (work.kind, work.num_videos, work.video_frames, work.video_fps) == ("video", 1, 8, 2.0)
    assert work.video_overlap == 0.5
    assert config.load.concurrency == 4 and config.round_size == 4
