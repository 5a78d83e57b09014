"""`epd bench`: flags -> BenchConfig -> run -> text tables, JSON and PNG plots.

services/runtime/cli.py hands `epd bench ...` here before its own parser runs (the
bench flags are not the server flags). Also runnable as `python -m services.bench`.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

from . import plots
from .config import (
    BenchConfig,
    BenchError,
    Endpoint,
    LoadConfig,
    WorkloadConfig,
    parse_extra_body,
    parse_image_sizes,
    parse_int_list,
    parse_slo,
)
from .report import to_json, write_json
from .runner import BenchOutcome, run_bench
from .tables import render


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse reports ArgumentTypeError as a usage error (exit 2); BenchError would escape."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except BenchError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = parse.__name__
    return convert


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epd bench", description="Load generator for OpenAI-compatible chat "
                                "endpoints (vLLM's benchmark definitions). See docs/bench.md.")
    p.add_argument("url", nargs="?", help="endpoint: http://host:port, .../v1 or .../v1/chat/completions")
    p.add_argument("--compare", nargs=2, metavar=("URL_A", "URL_B"), help="run two endpoints alternately")
    p.add_argument("--model", help="model name for A (default: first id of GET /v1/models)")
    p.add_argument("--model-b", help="model name for B in --compare (default: its /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (OPENAI_API_KEY)")
    p.add_argument("--extra-body", metavar="JSON", help="fields merged into A's bodies; null removes one, "
                   "e.g. '{\"ignore_eos\": null}' for servers that reject unknown fields")
    p.add_argument("--extra-body-b", metavar="JSON", help="same for B in --compare")
    _workload_flags(p.add_argument_group("workload"))
    _load_flags(p.add_argument_group("load"))
    out = p.add_argument_group("figures and output")
    out.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:500 tpot:50 e2el:5000")
    out.add_argument("--metrics-url", action="append", default=[], help="Prometheus URL of A (repeatable): "
                     "coordinator and encode instances, for the encoder-cache hit ratio")
    out.add_argument("--metrics-url-b", action="append", default=[], help="same for B in --compare")
    out.add_argument("--calibrate", action="store_true", help="measure the client against a null server first")
    out.add_argument("--sweep", type=_flag_type(parse_int_list), default=(), metavar="C1,C2,...",
                     help="concurrency sweep")
    out.add_argument("--round-size", type=int, default=0, help="requests per compare round (0: automatic)")
    out.add_argument("--settle-s", type=float, default=0.0, help="compare: before each side's part of a round, "
                     "wait up to this many seconds for the CPUs to be 90%% idle (a server that stays busy after "
                     "answering does not slow the other side's requests)")
    out.add_argument("--output", help="write results as JSON here")
    out.add_argument("--plot-dir", help="write PNG plots (latency CDFs, sweep) into this folder")
    out.add_argument("--save-requests", action="store_true", help="include per-request rows in the JSON")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _workload_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--workload", default="random-mm", choices=("random-mm", "text", "replay", "video"),
                   help="random-mm: random words then images (vLLM's random multimodal); text: no images; "
                   "replay: bodies from --replay-file; video: random words then generated clips (--video-*)")
    g.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens (sent with ignore_eos)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*[1-r, 1+r]")
    g.add_argument("--images-per-request", type=int, default=1, help="images per request (random-mm)")
    g.add_argument("--image-sizes", type=_flag_type(parse_image_sizes), default=parse_image_sizes("224x224"),
                   metavar="WxH:P,...", help="size buckets with probabilities, e.g. 224x224:0.5,448x448:0.5")
    g.add_argument("--image-pool", type=int, default=0, help="draw images from N distinct ones (0: all unique)")
    g.add_argument("--image-format", default="jpeg", choices=("jpeg", "png"), help="how images are encoded "
                   "in their data URLs")
    g.add_argument("--videos-per-request", type=int, default=1, help="videos per request (workload video)")
    g.add_argument("--video-frames", type=int, default=8, help="frames per clip (at 2 fps every one is sampled)")
    g.add_argument("--video-size", type=_flag_type(parse_image_sizes), default=parse_image_sizes("224x224"),
                   help="clip frame size WxH")
    g.add_argument("--video-fps", type=float, default=2.0, help="the clips' frame rate")
    g.add_argument("--video-pool", type=int, default=0, help="draw clips from N distinct ones (0: all unique)")
    g.add_argument("--video-overlap", type=float, default=0.0, help="share of each clip's frames repeated from the "
                   "clip before (a sliding window over one recording; whole frame groups of two frames)")
    g.add_argument("--replay-file", help="JSONL of chat request bodies (workload replay)")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    g.add_argument("--seed", type=int, default=None, help="workload and arrival seed (default: a fresh one per "
                   "run, printed, so a second run never finds the first one's images in the encoder cache; "
                   "give the printed one to send the same requests again)")


def _load_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--concurrency", type=int, help="closed loop of N workers (cap in rate mode)")
    g.add_argument("--request-rate", type=float, default=math.inf, help="open-loop arrivals per second")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    g.add_argument("--num-requests", type=int, help="requests per level and endpoint (default 100)")
    g.add_argument("--duration", type=float, help="seconds per level and endpoint (instead of a count)")
    g.add_argument("--warmup", type=int, default=0, help="unmeasured requests per endpoint first")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    urls = args.compare or ([args.url] if args.url else [])
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    if not urls or (args.compare and args.url):
        raise BenchError("give one endpoint URL, or --compare URL_A URL_B")
    models, metrics = (args.model, args.model_b), (tuple(args.metrics_url), tuple(args.metrics_url_b))
    extras = (parse_extra_body(args.extra_body), parse_extra_body(args.extra_body_b))
    endpoints = tuple(Endpoint(u, models[i], metrics[i], "AB"[i], extras[i]) for i, u in enumerate(urls))
    workload = WorkloadConfig(
        kind=args.workload, input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        images_per_request=args.images_per_request, image_sizes=args.image_sizes, image_pool=args.image_pool,
        image_format=args.image_format, replay_file=args.replay_file, ignore_eos=not args.no_ignore_eos,
        seed=seed, videos_per_request=args.videos_per_request, video_frames=args.video_frames,
        video_size=args.video_size[0], video_fps=args.video_fps, video_pool=args.video_pool,
        video_overlap=args.video_overlap)
    count = args.num_requests if args.num_requests or args.duration else 100
    load = LoadConfig(concurrency=args.concurrency, request_rate=args.request_rate, burstiness=args.burstiness,
                      num_requests=count, duration_s=args.duration, warmup=args.warmup, seed=seed,
                      timeout_s=args.timeout)
    return BenchConfig(endpoints, workload, load, parse_slo(args.goodput), tuple(args.sweep), args.round_size,
                       args.calibrate, args.api_key, not args.no_progress, args.save_requests,
                       seed_given=args.seed is not None, settle_s=args.settle_s)


def write_plots(outcome: BenchOutcome, doc: dict[str, object], folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for level, level_doc in zip(outcome.levels, doc["levels"], strict=True):  # type: ignore[call-overload]
        name = f"latency_cdf_c{level.load.max_in_flight}.png" if outcome.config.sweep else "latency_cdf.png"
        paths.append(os.path.join(folder, name))
        title, names = plots.describe(doc, level_doc)
        plots.latency_cdfs(level, paths[-1], title, names)
    if outcome.config.sweep:
        paths.append(os.path.join(folder, "sweep.png"))
        title, names = plots.describe(doc)
        plots.sweep(doc, paths[-1], title, names)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        outcome = run_bench(config)
    except BenchError as exc:
        print(f"epd bench: {exc}", file=sys.stderr)
        return 2
    doc = to_json(outcome)
    print(render(doc))
    if args.output:
        write_json(doc, args.output)
        print(f"wrote {args.output} (the full results, {doc['schema']})", file=sys.stderr)
    if args.plot_dir:
        for path in write_plots(outcome, doc, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s["completed"] for level in doc["levels"] for s in level["results"].values()) else 1
