"""KV memory held / (tokens held x bytes per token) in the paged decode engine, 16 mixed streams.

The decode role's own `DecodeEngine` runs in process: 16 requests with prompts of mixed
lengths (random KV: memory does not depend on the values) and mixed output lengths, all
submitted at once, greedy with ignore_eos.  While they run, the engine's own counters
(`engine.stats().kv`: blocks used x block bytes, tokens held) are sampled every few ms; the
figure is the largest ratio seen while all 16 streams are held (1.0 = no waste; paging wastes
at most one partial block per request, so as the last short streams finish alone the ratio
rises towards 1 + block/tokens: reported too, as "worst_any_time").  For contrast the same moment is priced the
pre-paging way: slots x max_model_len preallocated per request, and rows padded to the
longest (what a padded batch attends over).

    python -m benchmarks.kv_memory [--quick] [--model tiny|medium]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from typing import Any

from benchmarks.common import Figure, machine, print_figures, results_dir, write_doc_block, write_json


def _engine(model: str, max_model_len: int, block_size: int) -> Any:
    from services.decode.engine import DecodeEngine
    from services.models.demo import demo_model_path
    from services.models.processing import load_tokenizer
    from services.models.registry import adapter_for

    path = demo_model_path(model)
    lm = adapter_for(path).load_language(path, "cpu", "float32", max_model_len)
    return DecodeEngine(lm, load_tokenizer(path), 16, max_model_len, stream_timeout=600.0, block_size=block_size,
                        kv_cache_bytes=1 << 30)


def measure(model: str, prompt_lens: list[int], output_lens: list[int], block_size: int = 16) -> dict[str, Any]:
    import torch

    from services.generation.params import DecodeParams

    max_model_len = max(p + o for p, o in zip(prompt_lens, output_lens, strict=True)) + block_size
    engine = _engine(model, max_model_len, block_size)
    layout = engine.lm.layout
    samples: list[dict[str, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            stats = engine.stats()
            kv = stats.kv
            if kv.tokens_held:
                samples.append({"ratio": kv.held_ratio, "tokens": kv.tokens_held, "blocks": kv.used_blocks,
                                "reserved": kv.reserved_blocks, "streams": stats.active + stats.queued})
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        streams = []
        for i, (prompt, out) in enumerate(zip(prompt_lens, output_lens, strict=True)):
            kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, prompt, layout.head_dim, dtype=layout.dtype)
            params = DecodeParams(temperature=0.0, max_tokens=out, ignore_eos=True)
            streams.append(engine.submit(f"m{i}", kv, prompt, 0, 100 + i, params))
        sampler.start()
        for stream in streams:
            stream.collect()
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join(5)   # not left running into interpreter exit (it printed "terminate called ...")
        engine.close()
    per_token = engine.pool.block_bytes // block_size
    full = [s for s in samples if s["streams"] == len(prompt_lens)] or samples
    worst = max(full, key=lambda s: s["ratio"])
    tail = max(samples, key=lambda s: s["ratio"])
    return {"samples": len(full), "max_ratio": worst["ratio"], "at": worst, "bytes_per_token": per_token,
            "mean_ratio": sum(s["ratio"] for s in full) / len(full), "block_size": block_size,
            "worst_any_time": tail,
            "prompt_lens": prompt_lens, "output_lens": output_lens, "max_model_len": max_model_len,
            "preallocated_ratio": 16 * max_model_len / worst["tokens"]}


def run(quick: bool = False, model: str = "tiny") -> list[Figure]:
    rng = random.Random(11)
    prompt_lens = [rng.randint(20, 200 if quick else 1500) for _ in range(16)]
    output_lens = [rng.randint(8, 24 if quick else 160) for _ in range(16)]
    result = measure(model, prompt_lens, output_lens)
    where = machine()
    write_json({"machine": where, "result": result}, results_dir(quick) / f"kv_memory{'_quick' if quick else ''}.json")
    note = (f"{result['samples']} samples of the engine's counters; worst at {result['at']['tokens']} tokens in "
            f"{result['at']['blocks']} blocks of {result['block_size']}; mean {result['mean_ratio']:.3f}; worst with "
            f"fewer streams {result['worst_any_time']['ratio']:.3f} ({result['worst_any_time']['streams']} left); "
            f"slots x max_model_len would hold {result['preallocated_ratio']:.1f}x")
    return [Figure(f"KV memory held / (tokens held x bytes per token), 16 mixed streams ({model} model)",
                   result["max_ratio"], 1.1, "le", detail=result, note=note)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny", help="demo size: tiny | medium")
    args = parser.parse_args(argv)
    figures = run(args.quick, args.model)
    if not args.quick:
        command = " ".join(["python -m benchmarks.kv_memory", *(sys.argv[1:] if argv is None else argv)])
        write_doc_block("decode-kv-memory", command, figures)
    print_figures(figures, "decode KV memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
