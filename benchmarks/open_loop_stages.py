"""Where a request's time goes under Poisson arrivals: this epd against epd at a git ref, one open-loop run each.

    python -m benchmarks.open_loop_stages                  # demo-medium, 2 req/s, 40 image requests, vs 311e186
    python -m benchmarks.open_loop_stages --rate 0.5 --no-docs
    python -m benchmarks.open_loop_stages --quick          # tiny model, 6 requests, vs itself, temp folder

Each side is a fresh `epd serve` with `EPD_ACTIVITY_DIR` (every process logs its compute spans on one clock:
services/observability/activity.py), loaded by `vllm bench serve` at one rate (benchmarks/open_loop.py's image
workload: one random 224x224 image, 64 random tokens, 48 output tokens), the same seed on both sides; the sides
run one after the other, each alone on the machine.  For each side it reads, over the run: the coordinator's
per-request stage times (`epd_coordinator_stage_seconds`: render, encode, prefill) and TTFT, each model role's
forward time (`epd_stage_compute_seconds`), the compute-lease waits, decode's pauses for prompt work
(`epd_decode_yield_seconds_total`, 0 before it existed), and the stages' busy fraction of the run; and draws the
compute spans of the run's middle 10 s as one lane per stage (docs/img/open_loop_stages_<side>.png).  The default
baseline, 311e186, is epd before decode yielded to prompt-side forwards (the default before/after of
docs/benchmarks.md); the figures are this tree / the baseline.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, replace_block, results_dir, write_json
from benchmarks.open_loop import SERVED, Setup, _tree_with_kernels, run_bench
from benchmarks.procs import Server, exit_on_sigterm, running, start_epd
from benchmarks.stage_overlap import draw, summary

BEFORE = "311e186"          # epd before decode steps yielded to prompt-side forwards
STEPS = ("render", "encode", "prefill")
COMPUTE = ("encode", "prefill", "decode_step")
WINDOW_S = 10.0
_SAMPLE = re.compile(r'^(epd_[a-z_]+?)(?:_(sum|count|total))?(?:\{([^}]*)\})?\s+([-+.\deE]+|NaN)$')


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(metric name with its suffix, labels) -> value, epd's own metrics only."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(4) != "NaN":
            name = match.group(1) + (f"_{match.group(2)}" if match.group(2) else "")
            out[(name, match.group(3) or "")] = float(match.group(4))
    return out


def _mean_ms(before: dict, after: dict, name: str, labels: str) -> float | None:
    count = after.get((f"{name}_count", labels), 0.0) - before.get((f"{name}_count", labels), 0.0)
    total = after.get((f"{name}_sum", labels), 0.0) - before.get((f"{name}_sum", labels), 0.0)
    return round(1000 * total / count, 1) if count > 0 else None


def _snapshot(server: Server) -> dict[str, dict]:
    urls = {"coordinator": server.url, **{role: urls[0] for role, urls in server.roles.items()}}
    return {role: scrape(url) for role, url in urls.items()}


def run_side(setup: Setup, folder: Path, label: str, root: Path, rate: float, seed: int, png: Path | None
             ) -> dict[str, Any]:
    import time

    from services.observability.activity import read_spans

    activity = Path(tempfile.mkdtemp(prefix=f"epd-stages-{label}-"))
    server = start_epd(str(folder), "--served-model-name", SERVED, "--max-inflight-requests", "1024",
                       env={"EPD_ACTIVITY_DIR": str(activity)}, root=root)
    server.name = label
    with running(server):
        before = _snapshot(server)
        start = time.monotonic_ns()
        result = run_bench(setup, server, folder, "image", rate, activity, seed)
        end = time.monotonic_ns()
        after = _snapshot(server)
    spans = read_spans(activity)
    busy = summary(spans, start, end)
    coordinator = {step: _mean_ms(before["coordinator"], after["coordinator"], "epd_coordinator_stage_seconds",
                                  f'stage="{step}"') for step in STEPS}
    coordinator["first token (TTFT)"] = _mean_ms(before["coordinator"], after["coordinator"],
                                                 "epd_coordinator_ttft_seconds", "")
    compute = {stage: _mean_ms(before[role], after[role], "epd_stage_compute_seconds", f'stage="{stage}"')
               for stage, role in (("encode", "encode"), ("prefill", "prefill"), ("decode_step", "decode"))}
    lease = {stage: _mean_ms(before[stage], after[stage], "epd_compute_lease_wait_seconds", f'stage="{stage}"')
             for stage in ("encode", "prefill")}
    yielded = (after["decode"].get(("epd_decode_yield_seconds_total", ""), 0.0)
               - before["decode"].get(("epd_decode_yield_seconds_total", ""), 0.0))
    steps = (after["decode"].get(("epd_stage_compute_seconds_count", 'stage="decode_step"'), 0.0)
             - before["decode"].get(("epd_stage_compute_seconds_count", 'stage="decode_step"'), 0.0))
    compute["decode_step pause"] = round(1000 * yielded / steps, 1) if steps else None   # inside decode_step
    if png is not None:   # the run's middle WINDOW_S seconds
        middle = (start + end) // 2
        lo, hi = max(start, middle - int(WINDOW_S * 5e8)), min(end, middle + int(WINDOW_S * 5e8))
        draw(spans, lo, hi, png, f"{label}: compute spans under vllm bench serve, {rate:g} req/s (middle "
                                 f"{(hi - lo) / 1e9:.0f} s)")
    return {"label": label, "root": str(root), "bench": result, "coordinator_stage_ms": coordinator,
            "compute_ms": compute, "lease_wait_ms": lease, "decode_yield_s_per_s": round(yielded / ((end - start)
                                                                                                 / 1e9), 3),
            "busy": busy, "png": str(png.relative_to(ROOT)) if png is not None and png.is_relative_to(ROOT)
            else None}


def figures(doc: dict[str, Any]) -> list[Figure]:
    after, before = doc["sides"]
    out = []
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("median_tpot_ms", "TPOT p50")):
        a, b = after["bench"].get(key), before["bench"].get(key)
        out.append(Figure(f"{label}, {doc['rate']:g} req/s, this tree / {doc['baseline']}", ratio(a, b), None, "le",
                          note=f"{a:.1f} vs {b:.1f} ms"))
    return out


def stage_table(doc: dict[str, Any]) -> str:
    after, before = doc["sides"]
    rows = ["| per request, mean ms | " + " | ".join(s["label"] for s in (before, after)) + " |", "|---|---|---|"]

    def row(name: str, pick: Any) -> None:
        values = [pick(s) for s in (before, after)]
        rows.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:g}" for v in values) + " |")

    for step in (*STEPS, "first token (TTFT)"):
        row(f"coordinator: {step}", lambda s, step=step: s["coordinator_stage_ms"].get(step))
    for stage in (*COMPUTE, "decode_step pause"):
        row(f"forward: {stage}", lambda s, stage=stage: s["compute_ms"].get(stage))
    for stage in ("encode", "prefill"):
        row(f"lease wait: {stage}", lambda s, stage=stage: s["lease_wait_ms"].get(stage))
    row("decode paused for prompt work, s per s", lambda s: s["decode_yield_s_per_s"])
    for stage in COMPUTE:
        row(f"busy fraction: {stage}", lambda s, stage=stage: round(s["busy"]["busy_fraction"].get(stage, 0.0), 3))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 requests, against itself, temp folder")
    parser.add_argument("--model", default="demo-medium")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--baseline", default=BEFORE, help=f"a git ref of epd, or self (default {BEFORE})")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md and its images alone")
    args = parser.parse_args(argv)
    from services.models.registry import resolve_model

    model = "demo" if args.quick else args.model
    setup = Setup(model=model, num_prompts=6 if args.quick else args.num_prompts, output_len=8 if args.quick else 48,
                  quick=args.quick)
    baseline = "self" if args.quick else args.baseline
    docs = not (args.quick or args.no_docs) and baseline == BEFORE and args.rate == 2.0 and model == "demo-medium"
    folder = resolve_model(model)
    where = machine()
    img = ROOT / "docs" / "img"
    sides = [run_side(setup, folder, "this tree", ROOT, args.rate, 7, img / "open_loop_stages_after.png"
                      if docs else None),
             run_side(setup, folder, f"epd@{baseline}", ROOT if baseline == "self" else _tree_with_kernels(baseline),
                      args.rate, 7, img / "open_loop_stages_before.png" if docs else None)]
    doc = {"setup": {"model": model, "rate": args.rate, "num_prompts": setup.num_prompts,
                     "output_len": setup.output_len, "workload": "image"},
           "machine": where, "rate": args.rate, "baseline": f"epd@{baseline}", "sides": sides}
    found = figures(doc)
    doc["figures"] = found
    path = write_json(doc, results_dir(args.quick) / "open_loop_stages.json")
    print_figures(found, f"open loop stages ({path})")
    print(stage_table(doc))
    if docs:
        command = "python -m benchmarks.open_loop_stages " + " ".join(sys.argv[1:] if argv is None else argv)
        from benchmarks.common import markdown_table

        body = (f"Command: `{command.strip()}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load "
                f"average {where['loadavg_at_start']}).  `vllm bench serve`, {setup.num_prompts} image requests at "
                f"{args.rate:g} req/s (Poisson), {model}, each side alone on the machine, the same requests.\n\n"
                f"{markdown_table(found)}\n\n{stage_table(doc)}\n\n"
                f"Before (epd@{baseline}), the compute spans of the run's middle 10 s:\n\n"
                "![before](img/open_loop_stages_before.png)\n\nAfter (this tree):\n\n"
                "![after](img/open_loop_stages_after.png)\n\n"
                "Before, decode was only niced: it still ran in the gaps of every encode and prefill forward and, "
                "once on a core, kept it for a scheduler slice while the prompt forward's other thread waited at "
                "its next barrier, so each forward took longer than alone and the next request's forward waited "
                "longer for the lease.  After, decode steps pause at a layer's start while a prompt-side forward "
                "runs (services/hostcpu/compute_lease.py): decode no longer computes inside the forwards, and its "
                "steps use the cores between them (a decode step's span includes its pauses: the pause row says how "
                "long they were).  Raw results: benchmarks/results/open_loop_stages.json.")
        replace_block(ROOT / "docs" / "benchmarks.md", "open-loop-stages", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
