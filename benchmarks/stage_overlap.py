"""Which stage is busy when: a c=16 run of epd with every role's compute spans logged, as a timeline.

    python -m benchmarks.stage_overlap            # medium demo model, c=16, 48 requests, writes the PNG
    python -m benchmarks.stage_overlap --quick    # tiny model, c=4, 8 requests (no PNG into docs)
    python -m benchmarks.stage_overlap --quick --epd-url URL --activity-dir DIR   # a running cluster

`epd serve` is started with `EPD_ACTIVITY_DIR` (services/observability/activity.py): render marks each chat it
renders, encode each vision forward, prefill each packed forward, decode each batched step, all on
one machine-wide clock (a running cluster started with `EPD_ACTIVITY_DIR=DIR` can be measured with
`--epd-url URL --activity-dir DIR`; only spans inside the window count).  After a warm-up the
measured requests run in a closed loop of `concurrency` clients (the `epd bench` load generator);
the spans inside that window are drawn as one lane per stage (docs/img/stage_overlap_c16.png) and
summarised: each stage's busy fraction (union of its spans / window) and how much of the time two or
more stages were busy at once, which is the point of splitting the pipeline into processes.  The
figures go to benchmarks/results/stage_overlap.json and the `stage-overlap` block of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, replace_block, results_dir, write_json
from benchmarks.procs import Server, attach_epd, exit_on_sigterm, running, start_epd

DOC = ROOT / "docs" / "benchmarks.md"
QUICK_FLAGS = ("--linear-kernel", "default")
PNG = ROOT / "docs" / "img" / "stage_overlap_c16.png"
STAGES = ("render", "encode", "prefill", "decode_step")
COLORS = {"render": (148, 103, 189), "encode": (255, 127, 14), "prefill": (44, 160, 44),
          "decode_step": (31, 119, 180)}


@dataclass(frozen=True)
class Setup:
    model: str = "medium"
    concurrency: int = 16
    requests: int = 48
    warmup: int = 4
    input_len: int = 64
    output_len: int = 48
    epd_flags: tuple[str, ...] = ()

    @classmethod
    def quick(cls) -> Setup:
        # Quick runs check the plumbing: skip the start-up timing of the linear kernels.
        return cls(model="tiny", concurrency=4, requests=8, warmup=2, input_len=32, output_len=8,
                   epd_flags=QUICK_FLAGS)


def run_load(server: Server, setup: Setup, requests: int) -> dict[str, Any]:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig, run_bench
    from services.bench.report import to_json

    config = BenchConfig(endpoints=(Endpoint(server.url, model=server.model_id(), extra_body={"temperature": 0.0}),),
                         workload=WorkloadConfig(input_len=setup.input_len, output_len=setup.output_len),
                         load=LoadConfig(concurrency=setup.concurrency, num_requests=requests, timeout_s=1800),
                         show_progress=False)
    return to_json(run_bench(config))


def union(spans: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The spans clipped to [start, end] and merged where they overlap."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans if b > start and a < end):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def summary(spans: dict[str, list[tuple[int, int]]], start: int, end: int) -> dict[str, Any]:
    """Busy fraction per stage, and the share of the window with 0, 1, 2, ... stages busy at once."""
    busy = {stage: union(spans.get(stage, []), start, end) for stage in STAGES}
    events = sorted([(a, 1) for s in busy.values() for a, _ in s] + [(b, -1) for s in busy.values() for _, b in s])
    time_at = [0] * (len(STAGES) + 1)
    level, last = 0, start
    for t, step in events:
        time_at[level] += t - last
        level, last = level + step, t
    time_at[level] += end - last
    window = end - start
    any_busy = window - time_at[0]
    return {"window_s": window / 1e9,
            "busy_fraction": {stage: sum(b - a for a, b in s) / window for stage, s in busy.items()},
            "stages_busy_fraction": {str(n): t / window for n, t in enumerate(time_at)},
            "overlap_of_busy": sum(time_at[2:]) / any_busy if any_busy else 0.0,
            "spans": {stage: sum(1 for a, b in s if b > start and a < end) for stage, s in spans.items()}}


def draw(spans: dict[str, list[tuple[int, int]]], start: int, end: int, path: Path, title: str) -> None:
    from PIL import Image, ImageDraw

    from services.bench.plots import _font, nice_ticks

    width, lane, left, top = 1400, 60, 110, 50
    image = Image.new("RGB", (width, top + lane * len(STAGES) + 60), "white")
    draw_ = ImageDraw.Draw(image)
    scale = (width - left - 20) / (end - start)
    draw_.text((left, 12), title, fill=(0, 0, 0), font=_font(15))
    for row, stage in enumerate(STAGES):
        y = top + row * lane
        draw_.text((8, y + lane / 2 - 8), stage, fill=(0, 0, 0), font=_font(13))
        draw_.rectangle([left, y + 8, width - 20, y + lane - 8], outline=(200, 200, 200))
        for a, b in union(spans.get(stage, []), start, end):
            x0, x1 = left + (a - start) * scale, left + (b - start) * scale
            draw_.rectangle([x0, y + 10, max(x1, x0 + 1), y + lane - 10], fill=COLORS[stage])
    axis = top + lane * len(STAGES) + 5
    for tick in nice_ticks(0.0, (end - start) / 1e9, 10):
        x = left + tick * 1e9 * scale
        if x <= width - 20:
            draw_.line([x, axis, x, axis + 5], fill=(0, 0, 0))
            draw_.text((x - 8, axis + 8), f"{tick:g}", fill=(0, 0, 0), font=_font(12))
    draw_.text((width // 2 - 40, axis + 28), "seconds", fill=(0, 0, 0), font=_font(13))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def markdown(result: dict[str, Any], setup: Setup, where: dict[str, Any], command: str) -> str:
    s = result["summary"]
    busy = " · ".join(f"{stage} {s['busy_fraction'][stage]:.0%}" for stage in STAGES)
    levels = " · ".join(f"{n}: {f:.0%}" for n, f in s["stages_busy_fraction"].items())
    return "\n".join([
        f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load average at "
        f"start {where['loadavg_at_start']}). {setup.requests} requests at c={setup.concurrency}, {setup.input_len} "
        f"words + one 224x224 image, {setup.output_len} output tokens, {setup.model} model; window "
        f"{s['window_s']:.1f} s, {result['output_tok_s']:.1f} output tok/s.",
        "",
        f"Busy share of the window: {busy}. Stages busy at once (share of the window): {levels}; two or more "
        f"stages were busy during **{s['overlap_of_busy']:.0%}** of the time any was.",
        "",
        f"![stage activity, c={setup.concurrency}](img/{PNG.name})",
    ])


def main(argv: list[str] | None = None) -> int:
    from services.models.demo import demo_model_path
    from services.observability.activity import ENV, read_spans

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, c=4, 8 requests")
    parser.add_argument("--epd-flag", action="append", default=[], help="extra `epd serve` flag (repeatable)")
    parser.add_argument("--epd-url", help="measure a running cluster of the setup's model (needs --activity-dir; "
                        "--epd-flag then does not apply)")
    parser.add_argument("--activity-dir", help=f"the {ENV} folder the running cluster writes its spans to")
    parser.add_argument("--no-docs", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if bool(args.epd_url) != bool(args.activity_dir):
        parser.error("--epd-url and --activity-dir go together")
    exit_on_sigterm()
    base = Setup.quick() if args.quick else Setup()
    setup = replace(base, epd_flags=base.epd_flags + tuple(args.epd_flag))
    where = machine()
    with tempfile.TemporaryDirectory(prefix="epd-activity-") as own_folder:
        folder = args.activity_dir or own_folder
        epd = (attach_epd(args.epd_url) if args.epd_url
               else start_epd(str(demo_model_path(setup.model)), *setup.epd_flags, env={ENV: folder}))
        with running(epd):
            run_load(epd, setup, setup.warmup)
            start = time.monotonic_ns()
            bench = run_load(epd, setup, setup.requests)
            end = time.monotonic_ns()
        spans = read_spans(folder)
    level = bench["levels"][0]["results"]["A"]
    result = {"summary": summary(spans, start, end), "setup": asdict(setup), "machine": where,
              "output_tok_s": level["completed"] * setup.output_len / (level.get("duration_s") or 1.0),
              "failed": level["failed"]}
    print(markdown(result, setup, where, "python -m benchmarks.stage_overlap " + " ".join(argv)))
    write_json(result, results_dir(args.quick) / f"stage_overlap{'_quick' if args.quick else ''}.json")
    docs = not (args.quick or args.no_docs or args.epd_url)
    draw(spans, start, end, PNG if docs else results_dir(args.quick) / PNG.name,
         f"epd stage activity, c={setup.concurrency}, {setup.model} model ({setup.requests} requests)")
    if docs:
        command = "python -m benchmarks.stage_overlap " + " ".join(argv)
        replace_block(DOC, "stage-overlap", markdown(result, setup, where, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
