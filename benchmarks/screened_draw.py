"""Temperature draws through the int8 LM head screen (services/sampling/screened.py) against the full float32 head.

The decode role's LanguageModel (panel linears, the fused step, as `epd serve` runs it here) sits in one
`DecodeRunner` at context C (random KV); one decode step of B rows at temperature T (no top-k, top-p or
logprobs: vLLM's and OpenAI's default sampling, what `vllm bench serve` and the RL rollouts send) runs with the
screen's draw and with the full head (the screen off), the order alternating every round.  Figures: the median
step time with the draw / with the full head (below 1: faster), and the rows the draw left to the full head.

    python -m benchmarks.screened_draw [--quick] [--models medium,deep] [--batches 1,4,16,64] [--rounds N]
                                       [--temperatures 1.0,0.7]

--quick: the tiny model, batches 1 and 4, few rounds (docs untouched).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json
from benchmarks.decode_runner import make_runner


def measure(model: str, batches: list[int], rounds: int, context: int, temperature: float) -> dict[str, Any]:
    from services.generation.params import DecodeParams
    from services.models.head_screen import HeadScreen
    from services.sampling.sampler import RowSampling

    runner, seqs = make_runner(model, [max(batches)], context, "panel")
    screen = HeadScreen(runner.lm.lm_head, kernel="int8")
    params = DecodeParams(temperature=temperature, max_tokens=1 << 20, ignore_eos=True)
    step_ms: dict[tuple[int, str], list[float]] = {(b, s): [] for b in batches for s in ("draw", "full")}
    index = 0

    def step(batch: int, side: str) -> None:
        nonlocal index
        runner.screen = screen if side == "draw" else None
        rows = [RowSampling(params, (), index=index) for _ in range(batch)]
        index += 1
        began = time.perf_counter()
        runner.step([100] * batch, [0] * batch, seqs[:batch], rows)
        step_ms[(batch, side)].append((time.perf_counter() - began) * 1e3)
        for seq in seqs[:batch]:   # back to `context` tokens: every sample sees the same context
            seq.truncate(context)

    for round_index in range(rounds):
        for batch in batches:
            for side in (("draw", "full") if round_index % 2 == 0 else ("full", "draw")):
                step(batch, side)
    return {"model": model, "temperature": temperature, "context": context,
            "step_ms": {f"{b}:{s}": v for (b, s), v in step_ms.items()},
            "rows_drawn": screen.rows_screened, "rows_full": screen.rows_full}


def figures(result: dict[str, Any], batches: list[int]) -> list[Figure]:
    out = []
    model, temperature = result["model"], result["temperature"]
    for batch in batches:
        draw, full = (median(result["step_ms"][f"{batch}:{side}"]) for side in ("draw", "full"))
        out.append(Figure(f"decode step at T={temperature}, {model}, {batch} rows, screen draw / full head",
                          draw / full, unit="x",
                          note=f"median {draw:.2f} vs {full:.2f} ms"))
    out.append(Figure(f"rows the draw left to the full head, {model}, T={temperature}", result["rows_full"],
                      unit="count", note=f"of {result['rows_full'] + result['rows_drawn']} drawn"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="medium,deep")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--context", type=int, default=150)
    args = parser.parse_args(argv)
    models = ["tiny"] if args.quick else args.models.split(",")
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    rounds = 3 if args.quick else args.rounds
    results, figs = [], []
    for model in models:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            result = measure(model, batches, rounds, args.context, temperature)
            results.append(result)
            figs += figures(result, batches)
    print_figures(figs, "temperature draw through the screen / full float32 head")
    doc = {"machine": machine(), "rounds": rounds, "batches": batches, "results": results,
           "figures": [f.as_dict() for f in figs]}
    write_json(doc, results_dir(args.quick) / "screened_draw.json")
    if not args.quick:
        write_doc_block("screened-draw", "python -m benchmarks.screened_draw", figs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
