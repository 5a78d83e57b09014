"""epd in bfloat16 vs epd in float32, two medium clusters side by side (benchmarks/omp_team.py's harness).

A = `epd serve --model demo-medium --dtype bfloat16` (encode and prefill on oneDNN's bf16 GEMMs, decode in
float32 over bfloat16 weight panels: docs/architecture.md), B = the same in float32.  Workload: 64 words + one
224x224 image, 48 output tokens (greedy, ignore_eos), alternating in rounds at c=1 and c=16.  Figures, A / B:
TTFT p50 and TPOT p50 at c=1, output tok/s at c=16.  Worth it only on a CPU with AMX or AVX512-BF16
(`python -m benchmarks.bf16_gemm` says in 30 s).  The default run rewrites its docs/benchmarks.md block and
benchmarks/results/epd_dtype.json.

    python -m benchmarks.epd_dtype [--quick] [--no-docs] [--levels 1:8,16:32]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import omp_team
from benchmarks.common import Figure, print_figures, ratio, results_dir, write_doc_block, write_json
from benchmarks.side_by_side import parse_levels

A_FLAGS, B_FLAGS = "--dtype bfloat16", "--dtype float32"


def run(quick: bool = False, levels: tuple[tuple[int, int], ...] | None = None) -> tuple[list[Figure], dict]:
    figures, doc = omp_team.run(quick, A_FLAGS, B_FLAGS, levels)
    for figure in list(figures):
        if figure.name.startswith("TTFT p50, c=1"):
            a, b = figure.detail["A"], figure.detail["B"]
            figures.append(Figure(figure.name.replace("TTFT", "TPOT"), ratio(a["tpot_p50_ms"], b["tpot_p50_ms"]),
                                  None, "le", detail=figure.detail, note=figure.note))
    return figures, doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--levels", help="concurrency:requests,... (default 1:8,16:32)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    figures, doc = run(args.quick, parse_levels(args.levels))
    print_figures(figures, f"A ({A_FLAGS}) vs B ({B_FLAGS})")
    if not (args.quick or args.levels or args.no_docs):
        write_json(doc, results_dir(False) / "epd_dtype.json")
        write_doc_block("epd-dtype", " ".join(["python -m benchmarks.epd_dtype", *argv]), figures,
                        f"A: `epd serve --model demo-medium {A_FLAGS}`; B: the same with `{B_FLAGS}`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
