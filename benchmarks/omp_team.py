"""One OpenMP team per model role vs the old threading, two epd clusters side by side.

A = `epd serve --model demo-medium` as shipped (`--single-omp-team on`, GOMP_SPINCOUNT 10000),
B = the same with `--single-omp-team off` (every thread of a role runs torch on all cores, libgomp's
default spin), or with the flags given by `--b-flags`.  Workload: 64 words + one 224x224 image,
48 output tokens (greedy, ignore_eos), requests alternating between the two clusters in rounds, at
c=1 and c=16; each side's part of a round waits for quiet CPUs first (up to 2 s; --quick: no wait, one
warm-up request, as the test suite runs it).  Figures: TTFT p50
A / B at c=1, output tok/s A / B at c=16 (the two things the threading changes: a lone request's
forwards, and three busy roles sharing two cores).  Only the default run rewrites docs/benchmarks.md
and benchmarks/results/omp_team.json.

    python -m benchmarks.omp_team [--quick] [--no-docs] [--a-flags "..."] [--b-flags "..."] [--levels 1:8,16:32]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from benchmarks.common import Figure, machine, print_figures, ratio, results_dir, write_doc_block, write_json
from benchmarks.procs import running, start_epd
from benchmarks.side_by_side import parse_levels, side_figures

LEVELS = ((1, 8), (16, 32))   # (concurrency, requests per side)
QUICK_LEVELS = ((1, 2), (4, 4))
DEFAULT_B = "--single-omp-team off"
SETTLE_S = 2.0


def run(quick: bool = False, a_flags: str = "", b_flags: str = DEFAULT_B,
        levels: tuple[tuple[int, int], ...] | None = None) -> tuple[list[Figure], dict[str, Any]]:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig, run_bench
    from services.bench.config import ImageSize
    from services.bench.report import to_json

    where = machine()
    model = "demo" if quick else "demo-medium"
    input_len, output_len = (16, 8) if quick else (64, 48)
    plan = levels or (QUICK_LEVELS if quick else LEVELS)
    done = []
    with running(*(start_epd(model, *shlex.split(flags), timeout_s=900) for flags in (a_flags, b_flags))) as (a, b):
        model_id = a.model_id()
        for concurrency, requests in plan:
            config = BenchConfig(
                endpoints=(Endpoint(a.url, model=model_id, label="A", extra_body={"temperature": 0.0}),
                           Endpoint(b.url, model=model_id, label="B", extra_body={"temperature": 0.0})),
                workload=WorkloadConfig(input_len=input_len, output_len=output_len, seed=concurrency,
                                        image_sizes=(ImageSize(224, 224),)),
                load=LoadConfig(concurrency=concurrency, num_requests=requests, warmup=1 if quick else 2,
                                timeout_s=1800),
                round_size=concurrency, show_progress=False, settle_s=0.0 if quick else SETTLE_S)
            done.extend(to_json(run_bench(config))["levels"])
    figures = []
    for level in done:
        sides = side_figures(level, output_len)
        a_side, b_side = sides["A"], sides["B"]
        note = (f"TTFT {_f(a_side['ttft_p50_ms'])} vs {_f(b_side['ttft_p50_ms'])} ms, TPOT {_f(a_side['tpot_p50_ms'])} "
                f"vs {_f(b_side['tpot_p50_ms'])} ms, tok/s {_f(a_side['output_tok_s'])} vs "
                f"{_f(b_side['output_tok_s'])}; failed {a_side['failed']}/{b_side['failed']}")
        c = level["concurrency"]
        if c == 1:
            figures.append(Figure(f"TTFT p50, c=1, {model} one image, A / B", ratio(a_side["ttft_p50_ms"],
                                  b_side["ttft_p50_ms"]), None, "le", detail=sides, note=note))
        else:
            figures.append(Figure(f"output tok/s, c={c}, {model} one image, A / B",
                                  ratio(a_side["output_tok_s"], b_side["output_tok_s"]), None, "ge", detail=sides,
                                  note=note))
    return figures, {"machine": where, "a_flags": a_flags, "b_flags": b_flags, "levels": done}


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--a-flags", default="", help="extra `epd serve` flags of cluster A")
    parser.add_argument("--b-flags", default=DEFAULT_B, help=f"extra `epd serve` flags of cluster B ({DEFAULT_B})")
    parser.add_argument("--levels", help="concurrency:requests,... (default 1:8,16:32)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    figures, doc = run(args.quick, args.a_flags, args.b_flags, parse_levels(args.levels))
    print_figures(figures, f"A ({args.a_flags or 'defaults'}) vs B ({args.b_flags})")
    default = not (args.quick or args.a_flags or args.levels) and args.b_flags == DEFAULT_B
    if default and not args.no_docs:
        write_json(doc, results_dir(False) / "omp_team.json")
        write_doc_block("omp-team", " ".join(["python -m benchmarks.omp_team", *argv]), figures,
                        f"A: `epd serve --model demo-medium` as shipped; B: the same with `{args.b_flags}`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
