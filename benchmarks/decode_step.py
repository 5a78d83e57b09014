"""Decode step time, eager vs compiled (services/decode/compiled.py), per model and batch size, in one run.

For each model (the tiny demo, SmolLM2-135M's real weights, the medium demo) the decode role's
LanguageModel with prepacked linears runs one `DecodeRunner.step` of B rows at context C (random
KV in the block pool, greedy sampling included), once with the eager forward and once with the
compiled graph of bucket B, alternating every round.  The figure is eager / compiled of the best
step times (above 1: compiled is faster); the median of the per-round ratios and the compile
time of each bucket (cold or warm cache, as found) are in the note.  Models are measured one
after another (one in memory at a time), batches and modes interleaved within a model.

    python -m benchmarks.decode_step [--quick] [--models tiny,smollm2,medium] [--batches 1,16]
                                     [--rounds N] [--threads T] [--context C]

--quick: the tiny model only, few rounds.  --threads 0 keeps torch's default (one per core); on a
machine shared with other jobs, 1 thread avoids OpenMP barriers waiting on a descheduled thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json

MODELS = {"tiny": "demo", "smollm2": "smollm2", "medium": "demo-medium"}


def make_runner(model: str, batches: list[int], context: int, kernel: str = "prepacked") -> tuple[Any, list[Any]]:
    """The decode role's model (its linears on `kernel`) in a runner of max(batches) rows, each row holding
    `context` tokens of random KV."""
    import torch

    from services.decode.block_pool import BlockPool, block_bytes
    from services.decode.request_blocks import RequestBlocks
    from services.decode.runner import DecodeRunner
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for, resolve_model
    from services.sampling.sampler import Sampler

    path = resolve_model(MODELS[model])
    lm = adapter_for(path).load_language(path, "cpu", "float32", context + 64)
    prepack_language(lm, kernel)
    layout, rows = lm.layout, max(batches)
    per_row = -(-(context + 8) // 16)
    pool = BlockPool(layout, rows * per_row * block_bytes(layout, 16), 16)
    runner = DecodeRunner(lm, pool, rows, context + 8, Sampler(0), step="eager")
    kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, context, layout.head_dim, generator=
                     torch.Generator().manual_seed(0))
    seqs = []
    for row in range(rows):
        assert pool.try_reserve(per_row)
        seqs.append(RequestBlocks(pool, per_row))
        seqs[-1].load(kv)
        runner.place(row, seqs[-1])
    return runner, seqs


def measure(model: str, batches: list[int], rounds: int, context: int) -> dict[str, Any]:
    from services.decode.compiled import CompiledStep, choose_step, pad_inputs
    from services.generation.params import DecodeParams
    from services.sampling.sampler import RowSampling

    runner, seqs = make_runner(model, batches, context)
    forward = runner.decoder.forward
    started = time.monotonic()
    compiled, report = choose_step(forward, "compiled", tuple(batches), lambda b: pad_inputs(
        b, max(batches), runner.max_blocks, runner.pool.scratch_block, runner.device), scope=runner.decoder.active)
    compile_s = time.monotonic() - started
    modes = {"eager": CompiledStep(forward), "compiled": compiled}
    greedy = DecodeParams(temperature=0.0)
    times: dict[tuple[int, str], list[float]] = {(b, m): [] for b in batches for m in modes}

    def step(batch: int) -> float:
        rows = [RowSampling(greedy, ()) for _ in range(batch)]
        began = time.perf_counter()
        runner.step([100] * batch, [0] * batch, seqs[:batch], rows)
        took = time.perf_counter() - began
        for seq in seqs[:batch]:   # back to `context` tokens: every sample sees the same context
            seq.truncate(context)
        return took

    for round_ in range(rounds + 1):        # round 0 warms up
        for batch in batches:
            for name, chosen in modes.items():
                runner.compiled = chosen
                took = step(batch)
                if round_:
                    times[(batch, name)].append(took * 1e3)
    runner.compiled = compiled
    results = {}
    for batch in batches:
        eager, comp = times[(batch, "eager")], times[(batch, "compiled")]
        bucket = report.buckets.get(batch)
        results[batch] = {"eager_ms": eager, "compiled_ms": comp, "best_ratio": min(eager) / min(comp),
                          "median_ratio": median([e / c for e, c in zip(eager, comp, strict=True)]),
                          "compile_s": bucket.compile_s if bucket else None,
                          "compiled": bucket is not None and bucket.mode == "compiled",
                          "note": bucket.note if bucket else ""}
    return {"model": model, "context": context, "rounds": rounds, "compile_total_s": compile_s,
            "report": report.line(), "batches": results}


def run(quick: bool = False, models: list[str] | None = None, batches: list[int] | None = None,
        rounds: int | None = None, threads: int = 0, context: int = 128) -> list[Figure]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    models = models or (["tiny"] if quick else list(MODELS))
    batches = batches or [1, 16]
    rounds = rounds or (5 if quick else 30)
    where = machine()
    figures, raw = [], []
    for model in models:
        result = measure(model, batches, rounds, context)
        raw.append(result)
        for batch, r in result["batches"].items():
            note = (f"best eager {min(r['eager_ms']):.2f} ms / compiled {min(r['compiled_ms']):.2f} ms; median "
                    f"per-round ratio {r['median_ratio']:.2f}; compile {r['compile_s'] or 0:.0f} s"
                    + ("" if r["compiled"] else f"; NOT compiled: {r['note']}"))
            figures.append(Figure(f"decode step eager / compiled, {model}, batch {batch}, context {context}",
                                  r["best_ratio"] if r["compiled"] else None, None, detail={"measured": {
                                      "time": where["time"], "loadavg": where["loadavg_at_start"]}, **r},
                                  note=note))
    where["loadavg_at_end"] = machine()["loadavg_at_start"]
    write_json({"machine": where, "threads": torch.get_num_threads(), "results": raw},
               results_dir(quick) / f"decode_step{'_quick' if quick else ''}.json")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="", help=f"comma-separated: {', '.join(MODELS)} (default: all)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m] or None
    batches = [int(b) for b in args.batches.split(",") if b]
    figures = run(args.quick, models, batches, args.rounds or None, args.threads, args.context)
    if not args.quick:
        command = " ".join(["python -m benchmarks.decode_step", *(sys.argv[1:] if argv is None else argv)])
        import torch

        write_doc_block("decode-step", command, figures, extra=f"torch threads: {torch.get_num_threads()}.")
    print_figures(figures, "decode step: eager vs compiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
