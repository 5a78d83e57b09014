"""TTFT at c=1, one image per request, on the head_dim-32 small checkpoint: epd / vLLM CPU, 224x224 and 1024x768.

    python -m benchmarks.ttft_vs_vllm            # 12 requests per side per image size, after 2 warm-up
    python -m benchmarks.ttft_vs_vllm --quick    # 4 per side (smoke: still starts vLLM, minutes)
    python -m benchmarks.ttft_vs_vllm --epd-flag=--role-nice=decode=5   # a variant (its own JSON, docs untouched)

The small checkpoint (benchmarks.peers.vllm_checkpoints "qwen2_vl": hidden 128, head_dim 32, the smallest
vLLM's CPU attention accepts) makes compute small, so the figure is mostly what each system spends around
it: for the large image, moving and processing pixels.  Both servers start once on the same folder (vLLM
from the shared cached venv, FACTS.md's fixes; epd `epd serve` with shm connectors) and each image size
runs `epd bench --compare` rounds alternating A B / B A, greedy, 8 output tokens.  Targets (issue 11):
epd / vLLM <= 1.0x at both sizes.  Writes benchmarks/results/ttft_vs_vllm.json and the table between the
`datapath-ttft` markers of docs/benchmarks.md (unless --quick or --no-docs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, replace_block, results_dir, write_json
from benchmarks.procs import exit_on_sigterm, running
from benchmarks.side_by_side import level, run_levels, side_figures
from benchmarks.vs_vllm import PEER_EXTRA, VsVllm, start_both

DOC = ROOT / "docs" / "benchmarks.md"
SIZES = ((224, 224), (1024, 768))


def setups(requests: int, epd_flags: tuple[str, ...] = ()) -> list[VsVllm]:
    base = VsVllm(model="hd32", levels=((1, requests),), input_len=32, output_len=8, warmup=2, epd_flags=epd_flags)
    return [dataclasses.replace(base, image_size=size) for size in SIZES]


def measure(requests: int, epd_flags: tuple[str, ...] = ()) -> tuple[list[Figure], dict[str, Any]]:
    where = machine()
    runs = setups(requests, epd_flags)
    servers = start_both(runs[0])
    out: dict[str, Any] = {"machine": where, "sizes": {}}
    figures = []
    with running(servers.epd, servers.peer):
        for setup in runs:
            doc = run_levels(servers, setup, PEER_EXTRA, None, "ttft_vs_vllm")
            found = level(doc, 1)
            sides = side_figures(found, setup.output_len)
            epd, peer = sides["A"]["ttft_p50_ms"], sides["B"]["ttft_p50_ms"]
            low = {k: (found["results"][k].get("ttft_ms") or {}).get("min") for k in ("A", "B")}
            name = f"TTFT p50, c1, one {setup.image_size[0]}x{setup.image_size[1]} image, hd32 checkpoint, epd / vLLM"
            note = f"{epd:.1f} vs {peer:.1f} ms" if epd and peer else "n/a"
            if low["A"] and low["B"]:  # noise only adds: the fastest request of each side, beside the p50s
                note += f"; fastest {low['A']:.1f} vs {low['B']:.1f} ms ({low['A'] / low['B']:.2f}x)"
            figures.append(Figure(name, ratio(epd, peer), 1.0, "le", detail={**sides, "ttft_min_ms": low},
                                  note=note))
            out["sizes"][f"{setup.image_size[0]}x{setup.image_size[1]}"] = doc
    return figures, out


def markdown(figures: list[Figure], where: dict[str, Any], command: str) -> str:
    rows = ["| figure | epd / vLLM | target | |", "|---|---|---|---|"]
    rows += [f"| {f.name} | {f.value:.2f}x ({f.note}) | <= 1.0x | {f.verdict} |" if f.value is not None else
             f"| {f.name} | n/a | <= 1.0x | n/a |" for f in figures]
    return "\n".join([f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load "
                      f"average at start {where['loadavg_at_start']}).", "", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, help="measured requests per side per size (default 12)")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--epd-flag", action="append", default=[], help="extra `epd serve` flag (repeatable; "
                        "docs untouched)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    exit_on_sigterm()
    figures, doc = measure(args.requests or (4 if args.quick else 12), tuple(args.epd_flag))
    print_figures(figures, "TTFT epd vs vLLM CPU (small checkpoint)")
    name = "ttft_vs_vllm_flags.json" if args.epd_flag else "ttft_vs_vllm.json"
    write_json({"figures": figures, "bench": doc, "epd_flags": args.epd_flag}, results_dir(args.quick) / name)
    if not (args.quick or args.no_docs or args.epd_flag):
        replace_block(DOC, "datapath-ttft", markdown(figures, doc["machine"],
                                                     ("python -m benchmarks.ttft_vs_vllm " + " ".join(argv)).strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
