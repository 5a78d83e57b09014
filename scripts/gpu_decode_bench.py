"""Decode tokens/s of the paged engine on a GPU at 1 and 16 streams vs Hugging Face `generate` there.

The medium demo model on `--device` (default cuda): the engine (attention "torch": the C kernel
is CPU-only) decodes `--tokens` tokens per stream from prefilled random KV of `--prompt-len`;
`generate` runs the same model (full, from the same folder) greedily with exactly `--tokens`
new tokens for a batch of 1 and of 16 copies of one prompt.  Prints one Markdown table.

    python scripts/gpu_decode_bench.py [--device cuda] [--tokens 64] [--prompt-len 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_tok_s(device: str, streams: int, tokens: int, prompt_len: int) -> float:
    import torch

    from services.decode.engine import DecodeEngine
    from services.generation.params import DecodeParams
    from services.models.demo import demo_model_path
    from services.models.processing import load_tokenizer
    from services.models.registry import adapter_for

    path = demo_model_path("medium")
    lm = adapter_for(path).load_language(path, device, "float32", 4096)
    layout = lm.layout
    with DecodeEngine(lm, load_tokenizer(path), 16, 4096, stream_timeout=600, attention="torch") as engine:
        def run(tag: str) -> float:
            params = DecodeParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            kvs = [torch.randn(layout.num_layers, 2, layout.num_kv_heads, prompt_len, layout.head_dim,
                               device=device) for _ in range(streams)]
            start = time.perf_counter()
            handles = [engine.submit(f"{tag}{i}", kv, prompt_len, 0, 100 + i, params) for i, kv in enumerate(kvs)]
            produced = sum(h.collect()[-1].completion_tokens - 1 for h in handles)
            return produced / (time.perf_counter() - start)

        run("warm")
        return max(run(f"r{r}-") for r in range(2))


def generate_tok_s(device: str, batch: int, tokens: int, prompt_len: int) -> float:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from services.models.demo import demo_model_path

    model = Qwen2VLForConditionalGeneration.from_pretrained(demo_model_path("medium")).to(device).eval()
    ids = torch.randint(0, 150000, (batch, prompt_len), device=device)
    best = 0.0
    for _ in range(3):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = max(best, batch * (tokens - 1) / (time.perf_counter() - start))  # first token is prefill's
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    args = parser.parse_args()
    print("| streams | epd engine tok/s | HF generate tok/s | epd / HF |\n|---|---|---|---|")
    for streams in (1, 16):
        ours = engine_tok_s(args.device, streams, args.tokens, args.prompt_len)
        theirs = generate_tok_s(args.device, streams, args.tokens, args.prompt_len)
        print(f"| {streams} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
