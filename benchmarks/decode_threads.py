"""Decode threads: `--decode-serial-rows 4` against 0, two epd clusters side by side.

A = `epd serve --model smollm2 --decode-serial-rows 4` (steps of up to 4 rows run on one thread: the
auto setting of unfused steps on a box of at most 2 cores), B = the same with `--decode-serial-rows 0`
(every step on torch's thread count: auto's setting for the fused step, which both clusters run by
default); SmolLM2 text, 64 words in, 64 tokens out (greedy, ignore_eos), requests alternating between
the two in rounds at c = 1, 2, 4 and 16.  The figure is TPOT p50 A / B (below 1: A is faster).  Both
clusters are up for the whole run, so each sees the other's idle cost.  `--serial A,B` compares other
values (say 2,1); `--levels` other concurrencies; `--fused off` measures the unfused step.  Only the
default run rewrites docs/benchmarks.md and benchmarks/results/decode_threads.json.

    python -m benchmarks.decode_threads [--quick] [--no-docs] [--serial 4,0] [--levels 1,2,4,16]
                                        [--fused auto|off]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.common import Figure, machine, print_figures, ratio, results_dir, write_doc_block, write_json
from benchmarks.procs import running, start_epd
from benchmarks.side_by_side import side_figures

LEVELS = ((1, 8), (2, 8), (4, 8), (16, 32))   # (concurrency, requests per side)
QUICK_LEVELS = ((1, 2), (2, 2))
DEFAULT_SERIAL = (4, 0)


def run(quick: bool = False, serial: tuple[int, int] = DEFAULT_SERIAL, levels_c: tuple[int, ...] = (),
        fused: str = "auto") -> tuple[list[Figure], dict[str, Any]]:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig, run_bench
    from services.bench.report import to_json
    from services.models.gguf import smollm2_path

    where = machine()
    smollm2_path()
    input_len, output_len = (16, 8) if quick else (64, 64)
    levels = []
    plan = QUICK_LEVELS if quick else tuple((c, 8) for c in levels_c) if levels_c else LEVELS
    with running(*(start_epd("smollm2", "--decode-slots", "16", "--decode-serial-rows", str(n),
                             "--decode-fused", fused, timeout_s=900)
                   for n in serial)) as (a, b):
        for concurrency, requests in plan:
            config = BenchConfig(
                endpoints=(Endpoint(a.url, model="smollm2", label="A", extra_body={"temperature": 0.0}),
                           Endpoint(b.url, model="smollm2", label="B", extra_body={"temperature": 0.0})),
                workload=WorkloadConfig(kind="text", input_len=input_len, output_len=output_len, seed=concurrency),
                load=LoadConfig(concurrency=concurrency, num_requests=requests, warmup=1, timeout_s=1800),
                round_size=concurrency, show_progress=False)
            levels.extend(to_json(run_bench(config))["levels"])
    figures = []
    for level in levels:
        sides = side_figures(level, output_len)
        tpot_a, tpot_b = sides["A"]["tpot_p50_ms"], sides["B"]["tpot_p50_ms"]
        name = f"TPOT p50, SmolLM2 c={level['concurrency']}, fused {fused}, serial rows {serial[0]} / {serial[1]}"
        figures.append(Figure(name, ratio(tpot_a, tpot_b), None, "le", detail=sides,
                              note=f"{_f(tpot_a)} vs {_f(tpot_b)} ms; tok/s {_f(sides['A']['output_tok_s'])} vs "
                                   f"{_f(sides['B']['output_tok_s'])}; failed {sides['A']['failed']}/"
                                   f"{sides['B']['failed']}"))
    return figures, {"machine": where, "serial": serial, "fused": fused, "levels": levels}


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--serial", default="4,0", help="the two --decode-serial-rows values, A,B")
    parser.add_argument("--fused", default="auto", choices=("auto", "off"), help="--decode-fused of both clusters")
    parser.add_argument("--levels", default="", help="concurrencies (default 1,2,4,16)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    serial = tuple(int(v) for v in args.serial.split(","))
    if len(serial) != 2:
        parser.error("--serial takes two values, A,B")
    levels = tuple(int(v) for v in args.levels.split(",") if v)
    figures, doc = run(args.quick, (serial[0], serial[1]), levels, args.fused)
    print_figures(figures, f"decode threads: serial rows {serial[0]} vs {serial[1]}")
    variant = "" if serial == DEFAULT_SERIAL and not levels and args.fused == "auto" else \
        f"_{serial[0]}v{serial[1]}" + ("_unfused" if args.fused == "off" else "")   # never overwrite the main run's
    write_json({"figures": figures, "bench": doc},
               results_dir(args.quick) / f"decode_threads{variant}{'_quick' if args.quick else ''}.json")
    if not args.quick and not args.no_docs and not variant:
        write_doc_block("decode-threads", ("python -m benchmarks.decode_threads " + " ".join(argv)).strip(), figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
