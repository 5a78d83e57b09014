"""How prefill runs several prompts: one forward each, or one packed forward (two attention paths).

    python -m benchmarks.prefill_packing                  # medium model, 16 prompts of 117 tokens, 2 threads
    python -m benchmarks.prefill_packing --quick          # tiny model
    python -m benchmarks.prefill_packing --linear-kernel prepacked

In one process, rounds alternate three ways of prefilling the same `count` prompts of `length`
tokens (what a c=16 run of the one-image workload hands prefill) and one long prompt:

- `sequential`: one forward per prompt (what prefill did before batching);
- `packed_mask`: one packed sequence through transformers' own sdpa with a block-diagonal causal
  4-D mask (T x T: every row scores every other prompt's keys and the mask throws them away);
- `packed_segments`: the engine's path (services/prefill/attention.py): one packed sequence,
  attention per prompt segment, KV written into the block pool.

The figures are the medians of `rounds` rounds, as time ratios against `sequential`, plus the
chunked prefill of one `long_len` prompt in chunks of `chunk` tokens against one forward.  The
`--linear-kernel` option applies services.models.prepack to the language model first (how the
prefill role runs: auto by default), so the same script tells whether prepacked GEMMs pay off at
prefill's row counts.  Results: benchmarks/results/prefill_packing[_quick].json.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.common import (
    ROOT,
    Figure,
    machine,
    markdown_table,
    median,
    print_figures,
    replace_block,
    results_dir,
    write_json,
)


@dataclass(frozen=True)
class Setup:
    model: str = "medium"
    count: int = 16
    length: int = 117
    long_len: int = 2048
    chunk: int = 512
    rounds: int = 3
    threads: int = 2
    linear_kernel: str = "auto"

    @classmethod
    def quick(cls) -> Setup:
        return cls(model="tiny", count=4, length=40, long_len=256, chunk=64, rounds=2)


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 100_000, (length,), generator=generator).tolist() for _ in range(count)]


def sequential(lm: Any, batch: list[list[int]]) -> None:
    import torch
    from transformers import DynamicCache

    for ids in batch:
        inputs = lm.prefill_inputs(ids, [])
        cache = DynamicCache()
        out = lm.model(inputs_embeds=inputs.inputs_embeds, position_ids=inputs.position_ids, cache=cache,
                       use_cache=True)
        lm.lm_head(out.last_hidden_state[:, -1])
        torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])   # the wire KV


def packed_mask(lm: Any, batch: list[list[int]]) -> None:
    import torch

    inputs = [lm.prefill_inputs(ids, []) for ids in batch]
    embeds = torch.cat([i.inputs_embeds for i in inputs], dim=1)
    positions = torch.cat([i.position_ids for i in inputs], dim=-1)
    total = embeds.shape[1]
    mask = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for ids in batch:
        end = start + len(ids)
        mask[start:end, start:end] = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        start = end
    out = lm.model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask[None, None], use_cache=False)
    ends = torch.tensor([len(ids) for ids in batch]).cumsum(0) - 1
    lm.lm_head(out.last_hidden_state[0, ends])


def time_it(fn: Any, *args: Any) -> float:
    import torch

    with torch.no_grad():
        started = time.perf_counter()
        fn(*args)
        return time.perf_counter() - started


def run(setup: Setup) -> tuple[list[Figure], dict[str, Any]]:
    import torch

    from services.models.demo import demo_model_path
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for
    from services.prefill.engine import PrefillEngine

    torch.set_num_threads(setup.threads)
    path = demo_model_path(setup.model)
    lm = adapter_for(path).load_language(path, max_model_len=max(4096, setup.long_len + 16))
    report = prepack_language(lm, setup.linear_kernel)
    batch, long = prompts(setup.count, setup.length), prompts(1, setup.long_len, seed=1)
    whole = PrefillEngine(lm, max_num_batched_tokens=max(setup.count * setup.length, setup.long_len),
                          prefix_cache_mb=0)
    chunked = PrefillEngine(lm, max_num_batched_tokens=setup.chunk, prefix_cache_mb=0)

    def engine(eng: PrefillEngine, jobs: list[list[int]]) -> None:
        for future in [eng.submit(ids) for ids in jobs]:
            future.result().release()

    ways = {"sequential": (sequential, lm, batch), "packed_mask": (packed_mask, lm, batch),
            "packed_segments": (engine, whole, batch), "long_one_forward": (engine, whole, long),
            "long_chunked": (engine, chunked, long)}
    for fn, *args in ways.values():  # warm-up
        time_it(fn, *args)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for index in range(setup.rounds):
        order = list(ways) if index % 2 == 0 else list(reversed(ways))
        for name in order:
            fn, *args = ways[name]
            times[name].append(time_it(fn, *args))
    med = {name: median(values) for name, values in times.items()}
    what = f"{setup.count} prompts of {setup.length} tokens, {setup.model} model, {setup.threads} threads"
    figures = [Figure(f"prefill time, packed + per-segment attention / one forward per prompt ({what})",
                      med["packed_segments"] / med["sequential"], unit="x",
                      note=f"{med['packed_segments'] * 1000:.0f} vs {med['sequential'] * 1000:.0f} ms"),
               Figure(f"prefill time, packed + block-diagonal mask / one forward per prompt ({what})",
                      med["packed_mask"] / med["sequential"], unit="x",
                      note=f"{med['packed_mask'] * 1000:.0f} vs {med['sequential'] * 1000:.0f} ms"),
               Figure(f"prefill time of one {setup.long_len}-token prompt, chunks of {setup.chunk} / one forward",
                      med["long_chunked"] / med["long_one_forward"], unit="x",
                      note=f"{med['long_chunked'] * 1000:.0f} vs {med['long_one_forward'] * 1000:.0f} ms")]
    return figures, {"times_s": times, "median_s": med, "linear_kernel": report.line()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--linear-kernel", choices=("auto", "prepacked", "default"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    setup = Setup.quick() if args.quick else Setup()
    changes = {"rounds": args.rounds, "threads": args.threads, "linear_kernel": args.linear_kernel}
    setup = replace(setup, **{k: v for k, v in changes.items() if v is not None})
    where = machine()
    figures, detail = run(setup)
    print_figures(figures, f"prefill packing ({detail['linear_kernel']})")
    name = "prefill_packing" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    write_json({"figures": figures, "setup": asdict(setup), "machine": where, **detail},
               results_dir(args.quick) / f"{name}.json")
    if not args.quick and not args.tag:
        command = " ".join(["python -m benchmarks.prefill_packing", *(sys.argv[1:] if argv is None else argv)])
        write_docs(figures, setup, where, detail["linear_kernel"], command)
    return 0


def write_docs(figures: list[Figure], setup: Setup, where: dict[str, Any], kernel: str, command: str) -> None:
    replace_block(ROOT / "docs" / "benchmarks.md", "prefill-packing",
                  f"Command: `{command}` ({where['time']}, load average at start {where['loadavg_at_start']}; "
                  f"{kernel}); medians of {setup.rounds} alternating rounds.\n\n" + markdown_table(figures))


if __name__ == "__main__":
    raise SystemExit(main())
