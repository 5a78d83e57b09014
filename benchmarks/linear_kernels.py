"""Decode step time per linear kernel (services/models/prepack.py), per model and batch, in one run.

For each model the decode role's LanguageModel is loaded once per kernel (F.linear "default",
oneDNN "prepacked", the C "panel" kernel), each with its own block pool and the same random KV,
and one `DecodeRunner.step` of B rows at context C runs on each in turn, every round (greedy
sampling included), so machine noise falls on all of them.  The figures are prepacked / panel of
the median step times (above 1: panel is faster); the note has each kernel's median and the
median of the per-round ratios, and whether the three gave the same greedy tokens.  Then the same
for the linears alone: every weight of the model once, in model order, at B rows (what a step
reads, without attention or elementwise work), and a plain sum over the same weights (the rate
memory streams them at: the ceiling of a one-row step).

    python -m benchmarks.linear_kernels [--quick] [--models smollm2,medium] [--batches 1,4,16]
                                        [--rounds N] [--threads T] [--context C]

--quick: the tiny model, batches 1 and 4, few rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json
from benchmarks.decode_runner import MODELS, make_runner

KINDS = ("default", "prepacked", "panel")


def _linears(lm: Any) -> list[Any]:
    from torch import nn

    from services.models.swapped import SwappedLinear

    return [m for m in [*lm.model.modules(), lm.lm_head] if isinstance(m, nn.Linear | SwappedLinear)]


def measure(model: str, batches: list[int], rounds: int, context: int) -> dict[str, Any]:
    import torch

    from services.generation.params import DecodeParams
    from services.sampling.sampler import RowSampling

    rows = max(batches)
    loaded = {kind: make_runner(model, [rows], context, kind) for kind in KINDS}
    greedy = DecodeParams(temperature=0.0)
    step_ms: dict[tuple[int, str], list[float]] = {(b, k): [] for b in batches for k in KINDS}
    gemm_ms: dict[tuple[int, str], list[float]] = {(b, k): [] for b in batches for k in KINDS}

    tokens: dict[tuple[int, str], list[int]] = {}

    def step(kind: str, batch: int) -> float:
        runner, seqs = loaded[kind]
        sampling = [RowSampling(greedy, ()) for _ in range(batch)]
        began = time.perf_counter()
        tokens[(batch, kind)] = runner.step([100] * batch, [0] * batch, seqs[:batch], sampling)
        took = time.perf_counter() - began
        for seq in seqs[:batch]:   # back to `context` tokens: every sample sees the same context
            seq.truncate(context)
        return took * 1e3

    @torch.inference_mode()
    def gemms(kind: str, batch: int) -> float:
        inputs: dict[int, torch.Tensor] = {}
        began = time.perf_counter()
        for linear in _linears(loaded[kind][0].lm):
            x = inputs.get(linear.in_features)
            if x is None:
                x = inputs[linear.in_features] = torch.randn(batch, linear.in_features)
            linear(x)
        return (time.perf_counter() - began) * 1e3

    weights = [linear.weight for linear in _linears(loaded["default"][0].lm)]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    read_ms: list[float] = []

    @torch.inference_mode()
    def read_all() -> float:     # the streaming ceiling: one sum over the same bytes
        began = time.perf_counter()
        for weight in weights:
            weight.sum()
        return (time.perf_counter() - began) * 1e3

    for round_ in range(rounds + 1):        # round 0 warms up
        for batch in batches:
            for kind in KINDS:
                took, gemm = step(kind, batch), gemms(kind, batch)
                if round_:
                    step_ms[(batch, kind)].append(took)
                    gemm_ms[(batch, kind)].append(gemm)
        read = read_all()
        if round_:
            read_ms.append(read)
    results = {}
    for batch in batches:
        per = {}
        for name, table in (("step", step_ms), ("linears", gemm_ms)):
            packed, panel = table[(batch, "prepacked")], table[(batch, "panel")]
            per[name] = {"median_ms": {k: median(table[(batch, k)]) for k in KINDS},
                         "ratio": median(packed) / median(panel),
                         "median_round_ratio": median([a / b for a, b in zip(packed, panel, strict=True)])}
        per["same_tokens"] = all(tokens[(batch, k)] == tokens[(batch, "default")] for k in KINDS)
        results[batch] = per
    return {"model": model, "context": context, "rounds": rounds, "batches": results, "weight_bytes": weight_bytes,
            "read_ms": median(read_ms)}


def run(quick: bool = False, models: list[str] | None = None, batches: list[int] | None = None,
        rounds: int | None = None, threads: int = 0, context: int = 128) -> list[Figure]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    models = models or (["tiny"] if quick else ["smollm2", "medium"])
    batches = batches or ([1, 4] if quick else [1, 4, 16])
    rounds = rounds or (3 if quick else 15)
    where = machine()
    figures, raw = [], []
    for model in models:
        result = measure(model, batches, rounds, context)
        raw.append(result)
        for batch, per in result["batches"].items():
            for name in ("step", "linears"):
                r = per[name]
                ms = r["median_ms"]
                rate = "" if name == "step" or batch != 1 else (
                    "; weights read at " + ", ".join(f"{k} {result['weight_bytes'] / ms[k] / 1e6:.1f}" for k in KINDS)
                    + f" GB/s (a plain sum over them: {result['weight_bytes'] / result['read_ms'] / 1e6:.1f} GB/s)")
                note = (f"median {name} ms: F.linear {ms['default']:.1f}, oneDNN prepacked {ms['prepacked']:.1f}, "
                        f"panel {ms['panel']:.1f}; median per-round ratio {r['median_round_ratio']:.2f}" + rate
                        + ("" if per["same_tokens"] else "; GREEDY TOKENS DIFFER between kernels"))
                what = "decode step" if name == "step" else "all linears once"
                figures.append(Figure(f"{what}, prepacked / panel, {model}, batch {batch}, context {context}",
                                      r["ratio"], None, detail={"measured": {"time": where["time"],
                                                                             "loadavg": where["loadavg_at_start"]},
                                                                **r, "same_tokens": per["same_tokens"]},
                                      note=note))
    where["loadavg_at_end"] = machine()["loadavg_at_start"]
    write_json({"machine": where, "threads": torch.get_num_threads(), "results": raw},
               results_dir(quick) / f"linear_kernels{'_quick' if quick else ''}.json")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="", help=f"comma-separated: {', '.join(MODELS)} (default smollm2,medium)")
    parser.add_argument("--batches", default="")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m] or None
    batches = [int(b) for b in args.batches.split(",") if b] or None
    figures = run(args.quick, models, batches, args.rounds or None, args.threads, args.context)
    if not args.quick and not args.no_docs:
        import torch

        command = " ".join(["python -m benchmarks.linear_kernels", *(sys.argv[1:] if argv is None else argv)])
        write_doc_block("linear-kernels", command, figures, extra=f"torch threads: {torch.get_num_threads()}.")
    print_figures(figures, "decode: linear kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
