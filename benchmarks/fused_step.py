"""Decode step time, eager vs fused (services/decode/fused.py), per model, batch size and thread count, in one run.

For each model (SmolLM2-135M's real weights, the medium demo; --quick: the tiny demo) the decode role's
LanguageModel with panel linears (as the decode role loads it when the fused step is on) runs one
`DecodeRunner.step` of B rows at context C (random KV in the block pool, greedy sampling included),
once through the eager paged forward and once fused, alternating every round.  The figure is
eager / fused of the best step times (above 1: fused is faster); the median of the per-round
ratios is in the note.  Models are measured one after another, batches, threads and modes
interleaved within a model.

    python -m benchmarks.fused_step [--quick] [--models smollm2,medium] [--batches 1,4,16]
                                    [--threads 1,2] [--rounds N] [--context C]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json
from benchmarks.decode_runner import make_runner


def measure(model: str, batches: list[int], threads: list[int], rounds: int, context: int) -> dict[str, Any]:
    import torch

    from services.generation.params import DecodeParams
    from services.sampling.sampler import RowSampling

    runner, seqs = make_runner(model, batches, context, kernel="panel")
    fused = runner.fused
    if fused is None:
        raise SystemExit(f"the fused step does not apply to {model}: {runner.step_report.reason}")
    greedy = DecodeParams(temperature=0.0)
    modes = {"eager": None, "fused": fused}
    times: dict[tuple[int, int, str], list[float]] = {(b, t, m): [] for b in batches for t in threads for m in modes}

    tokens: dict[tuple[int, int, str], list[int]] = {}

    def step(batch: int) -> tuple[float, list[int]]:
        rows = [RowSampling(greedy, ()) for _ in range(batch)]
        began = time.perf_counter()
        out = runner.step([100] * batch, [0] * batch, seqs[:batch], rows)
        took = time.perf_counter() - began
        for seq in seqs[:batch]:   # back to `context` tokens: every sample sees the same context
            seq.truncate(context)
        return took, out

    for round_ in range(rounds + 1):        # round 0 warms up
        for count in threads:
            runner.threads = count          # the runner sets torch's thread count per step
            for batch in batches:
                for name, chosen in modes.items():
                    runner.fused = chosen
                    took, out = step(batch)
                    tokens.setdefault((batch, count, name), out)
                    if round_:
                        times[(batch, count, name)].append(took * 1e3)
    runner.fused = fused
    results = {}
    for batch in batches:
        for count in threads:
            eager, fast = times[(batch, count, "eager")], times[(batch, count, "fused")]
            results[f"{batch}x{count}"] = {
                "batch": batch, "threads": count, "eager_ms": eager, "fused_ms": fast,
                "best_ratio": min(eager) / min(fast),
                "same_tokens": tokens[(batch, count, "eager")] == tokens[(batch, count, "fused")],
                "median_ratio": median([e / f for e, f in zip(eager, fast, strict=True)])}
    torch.set_num_threads(max(threads))
    return {"model": model, "context": context, "rounds": rounds, "results": results}


def run(quick: bool = False, models: list[str] | None = None, batches: list[int] | None = None,
        threads: list[int] | None = None, rounds: int | None = None, context: int = 128) -> list[Figure]:
    models = models or (["tiny"] if quick else ["smollm2", "medium"])
    batches = batches or ([1, 4] if quick else [1, 4, 16])
    threads = threads or [1, 2]
    rounds = rounds or (3 if quick else 20)
    where = machine()
    figures, raw = [], []
    for model in models:
        result = measure(model, batches, threads, rounds, context)
        raw.append(result)
        for r in result["results"].values():
            note = (f"best eager {min(r['eager_ms']):.2f} ms / fused {min(r['fused_ms']):.2f} ms; median per-round "
                    f"ratio {r['median_ratio']:.2f}; greedy tokens {'the same' if r['same_tokens'] else 'DIFFER'}")
            figures.append(Figure(f"decode step eager / fused, {model}, {r['batch']} rows, {r['threads']} "
                                  f"thread{'s' if r['threads'] > 1 else ''}, context {context}", r["best_ratio"],
                                  None, detail={"measured": {"time": where["time"],
                                                             "loadavg": where["loadavg_at_start"]}, **r}, note=note))
    where["loadavg_at_end"] = machine()["loadavg_at_start"]
    write_json({"machine": where, "results": raw}, results_dir(quick) / f"fused_step{'_quick' if quick else ''}.json")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="", help="comma-separated: tiny, smollm2, medium (default: the last two)")
    parser.add_argument("--batches", default="")
    parser.add_argument("--threads", default="", help="comma-separated torch thread counts (default 1,2)")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args(argv)

    def ints(text: str) -> list[int] | None:
        return [int(x) for x in text.split(",") if x] or None

    models = [m for m in args.models.split(",") if m] or None
    figures = run(args.quick, models, ints(args.batches), ints(args.threads), args.rounds or None, args.context)
    if not args.quick:
        command = " ".join(["python -m benchmarks.fused_step", *(sys.argv[1:] if argv is None else argv)])
        write_doc_block("fused-step", command, figures)
    print_figures(figures, "decode step: eager vs fused")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
