"""The LM head screen (services/models/head_screen.py) against the full float32 head, in one run.

For each model the decode role's LanguageModel (panel linears, the fused step, as `epd serve` runs it here)
sits in one `DecodeRunner` of 16 rows at context C (random KV), and one greedy step of B rows runs through
each screen kernel (default: the two best this CPU builds, int8 and the bfloat16 pairs on AVX512-VNNI/BF16)
and without a screen, the order alternating every round, so machine noise falls on all.  Figures, of the
median step times (below 1: faster): each screen / full head, and the first kernel / the second, for the
whole decode step and for the LM head alone (the head + argmax against the screen's argmax on the same
hidden rows).  Every round checks that all sides gave the same tokens.

    python -m benchmarks.head_screen [--quick] [--models smollm2,medium] [--batches 1,4,8,16] [--rounds N]
                                     [--kernels int8,pairs]

--quick: the tiny model, batches 1 and 4, few rounds (docs untouched).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json
from benchmarks.decode_runner import make_runner


def measure(model: str, batches: list[int], rounds: int, context: int, kernels: list[str]) -> dict[str, Any]:
    import torch

    from services.generation.params import DecodeParams
    from services.models.head_screen import HeadScreen
    from services.sampling.sampler import RowSampling, greedy_argmax

    runner, seqs = make_runner(model, [max(batches)], context, "panel")
    screens = {kernel: HeadScreen(runner.lm.lm_head, kernel=kernel) for kernel in kernels}   # auto's size rule aside
    sides = [*kernels, "full"]
    greedy = DecodeParams(temperature=0.0)
    step_ms: dict[tuple[int, str], list[float]] = {(b, s): [] for b in batches for s in sides}
    head_ms: dict[tuple[int, str], list[float]] = {(b, s): [] for b in batches for s in sides}
    same = True

    def step(batch: int, side: str) -> list[int]:
        runner.screen = screens.get(side)
        rows = [RowSampling(greedy, ()) for _ in range(batch)]
        began = time.perf_counter()
        tokens = runner.step([100] * batch, [0] * batch, seqs[:batch], rows)
        step_ms[(batch, side)].append((time.perf_counter() - began) * 1e3)
        for seq in seqs[:batch]:   # back to `context` tokens: every sample sees the same context
            seq.truncate(context)
        return tokens

    hidden = torch.randn(max(batches), runner.lm.lm_head.in_features, generator=torch.Generator().manual_seed(1))
    hidden = runner.lm.model.norm(hidden * 4)
    with torch.inference_mode():
        for round_index in range(rounds):
            for batch in batches:
                order = sides if round_index % 2 == 0 else sides[::-1]
                got = {side: step(batch, side) for side in order}
                same &= all(got[side] == got["full"] for side in sides)
                x = hidden[:batch].contiguous()
                for side in order:
                    began = time.perf_counter()
                    tokens = (screens[side].argmax(x) if side in screens
                              else greedy_argmax(runner.lm.lm_head(x)).tolist())
                    head_ms[(batch, side)].append((time.perf_counter() - began) * 1e3)
                    got[side] = tokens
                same &= all(got[side] == got["full"] for side in sides)
    runner.screen = screens[kernels[0]]
    return {"model": model, "kernels": kernels, "same_tokens": same,
            "extra_mib": {k: s.extra_bytes / 2**20 for k, s in screens.items()},
            "candidates_per_row": {k: s.candidates / max(s.rows_screened, 1) for k, s in screens.items()},
            "step_ms": {f"{b}:{s}": v for (b, s), v in step_ms.items()},
            "head_ms": {f"{b}:{s}": v for (b, s), v in head_ms.items()}}


def figures_of(result: dict[str, Any], batches: list[int]) -> list[Figure]:
    out = []
    kernels = result["kernels"]
    for what, key in (("decode step", "step_ms"), ("LM head alone", "head_ms")):
        for batch in batches:
            full = median(result[key][f"{batch}:full"])
            times = {kernel: median(result[key][f"{batch}:{kernel}"]) for kernel in kernels}
            for kernel in kernels:
                out.append(Figure(
                    f"{what}, {result['model']}, {batch} rows, {kernel} screen / full head", times[kernel] / full, None,
                    "le", detail={"screen_ms": times[kernel], "full_ms": full},
                    note=(f"median {times[kernel]:.2f} vs {full:.2f} ms; +{result['extra_mib'][kernel]:.0f} MiB; "
                          f"{result['candidates_per_row'][kernel]:.1f} float32 logits per row; tokens "
                          f"{'the same' if result['same_tokens'] else 'DIFFERENT'}")))
            if len(kernels) > 1:
                a, b = kernels[0], kernels[1]
                out.append(Figure(f"{what}, {result['model']}, {batch} rows, {a} screen / {b} screen",
                                  times[a] / times[b], None, "le",
                                  note=f"median {times[a]:.2f} vs {times[b]:.2f} ms"))
    return out


def _default_kernels() -> list[str]:
    from torch import nn

    from services.models.head_screen import HeadScreen
    from services.models.panel_linear import PanelLinear

    probe = PanelLinear(nn.Linear(16, 16, bias=False))
    found = []
    for kernel in ("int8", "pairs", "widened"):
        try:
            HeadScreen(probe, kernel=kernel)
        except ValueError:
            continue
        found.append(kernel)
    return found[:2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="smollm2,medium")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--kernels", default=None,
                        help="screen kernels, compared side by side (default: int8,pairs where the CPU has both)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    models = ["tiny"] if args.quick else args.models.split(",")
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    rounds = 3 if args.quick else args.rounds
    kernels = args.kernels.split(",") if args.kernels else _default_kernels()
    results, figures = [], []
    for model in models:
        results.append(measure(model, batches, rounds, args.context, kernels))
        figures.extend(figures_of(results[-1], batches))
    print_figures(figures, "LM head screen / full float32 head")
    if not all(r["same_tokens"] for r in results):
        print("the screen and the full head gave different tokens", file=sys.stderr)
        return 1
    if not args.quick:
        write_json({"machine": machine(), "results": results}, results_dir(False) / "head_screen.json")
        write_doc_block("head-screen", " ".join(["python -m benchmarks.head_screen", *argv]), figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
