"""Decode tokens/s at N concurrent streams vs 1 stream, on the decode role's own engine.

The decode role's `DecodeEngine` (continuous batching over KV slots) is driven in process
with prefilled KV of `prompt_len` tokens (random values: speed does not depend on them),
greedy, `ignore_eos`, `output_len` tokens each.  Tokens/s = tokens produced by decode steps
(the first token comes from prefill and is not counted) / wall time from submit to the last
final event.  The 1-stream and N-stream runs alternate `rounds` times and the medians are
compared, so machine noise falls on both.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import Figure, median, print_figures


@dataclass(frozen=True)
class DecodeSetup:
    model: str = "tiny"          # demo size
    prompt_len: int = 256
    output_len: int = 128
    num_slots: int = 16
    max_model_len: int = 2048


def load_engine(setup: DecodeSetup) -> Any:
    from services.decode.engine import DecodeEngine
    from services.models.demo import demo_model_path
    from services.models.processing import load_tokenizer
    from services.models.registry import adapter_for

    path = demo_model_path(setup.model)
    lm = adapter_for(path).load_language(path, "cpu", "float32", setup.max_model_len)
    return DecodeEngine(lm, load_tokenizer(path), setup.num_slots, setup.max_model_len,
                        max_queued=4 * setup.num_slots, stream_timeout=600.0)


def fake_kv(engine: Any, prompt_len: int) -> Any:
    import torch

    layout = engine.lm.layout
    return torch.randn(layout.num_layers, 2, layout.num_kv_heads, prompt_len, layout.head_dim, dtype=layout.dtype)


def run_streams(engine: Any, setup: DecodeSetup, num_streams: int, tag: str) -> dict[str, float]:
    """Submit `num_streams` requests at once; returns tokens/s and the engine's steps."""
    from services.generation.params import DecodeParams

    params = DecodeParams(temperature=0.0, max_tokens=setup.output_len, ignore_eos=True)
    kvs = [fake_kv(engine, setup.prompt_len) for _ in range(num_streams)]
    steps_before = engine.stats().steps
    started = time.perf_counter()
    streams = [engine.submit(f"{tag}-{i}", kv, setup.prompt_len, 0, 100 + i, params) for i, kv in enumerate(kvs)]
    tokens = sum(stream.collect()[-1].completion_tokens - 1 for stream in streams)
    elapsed = time.perf_counter() - started
    steps = engine.stats().steps - steps_before
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "steps": steps,
            "step_ms": elapsed / max(steps, 1) * 1e3}


def measure(setup: DecodeSetup, streams: tuple[int, ...], rounds: int) -> dict[int, dict[str, float]]:
    """Median tokens/s (and step time) per stream count; counts alternate within each round."""
    engine = load_engine(setup)
    try:
        run_streams(engine, setup, max(streams), "warmup")
        samples: dict[int, list[dict[str, float]]] = {n: [] for n in streams}
        for r in range(rounds):
            for n in streams if r % 2 == 0 else streams[::-1]:
                samples[n].append(run_streams(engine, setup, n, f"r{r}n{n}"))
    finally:
        engine.close()
    return {n: {key: median([s[key] for s in runs]) for key in runs[0]} for n, runs in samples.items()}


def figure(setup: DecodeSetup, rounds: int) -> Figure:
    many = setup.num_slots
    result = measure(setup, (1, many), rounds)
    one, batch = result[1], result[many]
    return Figure(f"decode tokens/s, {many} streams vs 1 ({setup.model} model)",
                  batch["tokens_per_s"] / one["tokens_per_s"], 8.0, "ge",
                  detail={"setup": setup.__dict__, "one": one, "many": batch, "rounds": rounds},
                  note=f"{batch['tokens_per_s']:.0f} vs {one['tokens_per_s']:.0f} tok/s; step "
                       f"{batch['step_ms']:.2f} vs {one['step_ms']:.2f} ms; prompt {setup.prompt_len}, "
                       f"{setup.output_len} out, median of {rounds}")


def run(quick: bool = False) -> list[Figure]:
    setup = DecodeSetup(prompt_len=64, output_len=8) if quick else DecodeSetup()
    return [figure(setup, 1 if quick else 5)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny", help="demo size: tiny | medium")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        figures = run(quick=True)
    else:
        setup = DecodeSetup(model=args.model, output_len=args.output_len, num_slots=args.streams)
        figures = [figure(setup, args.rounds)]
    print_figures(figures, "decode scaling")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
