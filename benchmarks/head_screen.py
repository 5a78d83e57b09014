"""The LM head screen (services/models/head_screen.py) against the full float32 head, in one run.

For each model the decode role's LanguageModel (panel linears, the fused step, as `epd serve` runs it here)
sits in one `DecodeRunner` of 16 rows at context C (random KV), and one greedy step of B rows runs with the
screen and without it (the runner's screen switched off for that step), alternating every round, so machine
noise falls on both.  Figures, screen / full head of the median step times (below 1: the screen is faster):
the whole decode step, and the LM head alone (the head + argmax against the screen's argmax on the same
hidden rows).  Every round checks that both sides gave the same tokens.

    python -m benchmarks.head_screen [--quick] [--models smollm2,medium] [--batches 1,4,8,16] [--rounds N]

--quick: the tiny model, batches 1 and 4, few rounds (docs untouched).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json
from benchmarks.decode_step import make_runner


def measure(model: str, batches: list[int], rounds: int, context: int) -> dict[str, Any]:
    import torch

    from services.decode.params import DecodeParams
    from services.decode.sampler import RowSampling, _argmax

    runner, seqs = make_runner(model, [max(batches)], context, "panel")
    screen = runner.screen
    if screen is None:
        raise SystemExit(f"the screen does not apply here: {runner.screen_report.line()}")
    greedy = DecodeParams(temperature=0.0)
    step_ms: dict[tuple[int, str], list[float]] = {(b, s): [] for b in batches for s in ("screen", "full")}
    head_ms: dict[tuple[int, str], list[float]] = {(b, s): [] for b in batches for s in ("screen", "full")}
    same = True

    def step(batch: int, side: str) -> list[int]:
        runner.screen = screen if side == "screen" else None
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
                sides = ("screen", "full") if round_index % 2 == 0 else ("full", "screen")
                got = {side: step(batch, side) for side in sides}
                same &= got["screen"] == got["full"]
                x = hidden[:batch].contiguous()
                for side in sides:
                    began = time.perf_counter()
                    tokens = screen.argmax(x) if side == "screen" else _argmax(runner.lm.lm_head(x)).tolist()
                    head_ms[(batch, side)].append((time.perf_counter() - began) * 1e3)
                    got[side] = tokens
                same &= got["screen"] == got["full"]
    runner.screen = screen
    return {"model": model, "kernel": screen.kernel, "extra_mib": screen.extra_bytes / 2**20, "same_tokens": same,
            "candidates_per_row": screen.candidates / max(screen.rows_screened, 1),
            "step_ms": {f"{b}:{s}": v for (b, s), v in step_ms.items()},
            "head_ms": {f"{b}:{s}": v for (b, s), v in head_ms.items()}}


def figures_of(result: dict[str, Any], batches: list[int]) -> list[Figure]:
    out = []
    for what, key in (("decode step", "step_ms"), ("LM head alone", "head_ms")):
        for batch in batches:
            screen, full = median(result[key][f"{batch}:screen"]), median(result[key][f"{batch}:full"])
            out.append(Figure(
                f"{what}, {result['model']}, {batch} rows, screen / full head", screen / full, None, "le",
                detail={"screen_ms": screen, "full_ms": full},
                note=(f"median {screen:.2f} vs {full:.2f} ms; {result['kernel']} kernel, +{result['extra_mib']:.0f} "
                      f"MiB; {result['candidates_per_row']:.1f} float32 logits per row; tokens "
                      f"{'the same' if result['same_tokens'] else 'DIFFERENT'}")))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="smollm2,medium")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--context", type=int, default=256)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    models = ["tiny"] if args.quick else args.models.split(",")
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    rounds = 3 if args.quick else args.rounds
    results, figures = [], []
    for model in models:
        results.append(measure(model, batches, rounds, args.context))
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
