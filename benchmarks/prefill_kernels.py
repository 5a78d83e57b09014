"""The prompt stages' small kernels against what they replace, and a prefill forward with and without them.

    python -m benchmarks.prefill_kernels            # 9 rounds
    python -m benchmarks.prefill_kernels --quick    # 3 rounds, tiny shapes (docs untouched)

Each figure is a ratio of median times measured in one run, rounds alternating the two sides, on the torch
threads this process has (2 on this project's box):

- causal attention of one prompt chunk (services/models/attention_kernel.py) / torch's
  `scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, at the medium demo model's shape (16 query
  heads over 4 kv heads of 64) for 117 (the vs_vllm prompt), 200, 512, 1,024 and 4,096 keys (past MAX_KEYS
  the role runs SDPA);
- the patch embedding on oneDNN's prepacked weight / on `F.linear` (256 patches, 1,176 -> 512);
- a whole prefill of a 117-token prompt through the medium model's PrefillEngine (prepacked as the role
  does, greedy first token) with the attention kernel / without it.
(The RoPE kernel these figures once included is gone: it gained nothing end to end, benchmarks.kernel_gains.)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json


def _alternate(a: Callable[[], Any], b: Callable[[], Any], rounds: int, calls: int) -> tuple[float, float]:
    """Median seconds per call of a and b, rounds alternating a b / b a."""
    times: dict[str, list[float]] = {"a": [], "b": []}
    for fn in (a, b):
        fn()
    for index in range(rounds):
        for side in ("ab" if index % 2 == 0 else "ba"):
            fn = a if side == "a" else b
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            times[side].append((time.perf_counter() - started) / calls)
    return median(times["a"]), median(times["b"])


def _figure(name: str, a: float, b: float, what: str) -> Figure:
    return Figure(name, a / b, None, "le", note=f"{a * 1e3:.3f} vs {b * 1e3:.3f} ms {what}",
                  detail={"a_ms": a * 1e3, "b_ms": b * 1e3})


def attention_figures(rounds: int, spans: list[int]) -> list[Figure]:
    import torch

    from services.models import attention_kernel

    if attention_kernel.load():
        return []
    gen = torch.Generator().manual_seed(0)
    limit = attention_kernel.MAX_KEYS
    attention_kernel.MAX_KEYS = max(spans)   # time the kernel past the span the role gives it, too
    try:
        return [_attention_figure(keys, rounds, gen, limit) for keys in spans]
    finally:
        attention_kernel.MAX_KEYS = limit


def _attention_figure(keys: int, rounds: int, gen: Any, limit: int) -> Figure:
    import torch
    import torch.nn.functional as F

    from services.models import attention_kernel

    q = torch.randn(keys, 16, 64, generator=gen).transpose(0, 1)
    k = torch.randn(keys, 4, 64, generator=gen).transpose(0, 1)
    v = torch.randn(keys, 4, 64, generator=gen).transpose(0, 1)
    out = torch.empty(keys, 16, 64)
    kernel_s, sdpa_s = _alternate(
        lambda: attention_kernel.run(q, k, v, out, 0, None),
        lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True),
        rounds, max(1, 2048 // keys))
    return _figure(f"causal attention, {keys} keys, 16/4 heads of 64: kernel / SDPA", kernel_s, sdpa_s,
                   "per layer" + (" (past MAX_KEYS: the role runs SDPA)" if keys > limit else ""))


def patch_embed_figure(rounds: int, patches: int) -> list[Figure]:
    import torch
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

    from services.models.fused_mlp import GemmPatchEmbed

    torch.manual_seed(2)
    embed = PatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=512)
    packed = GemmPatchEmbed(embed)
    if not packed.packed:
        return []
    plain = GemmPatchEmbed(embed)
    plain.packed = False
    plain.weight = torch.nn.Parameter(embed.proj.weight.detach().reshape(512, -1), requires_grad=False)
    x = torch.randn(patches, 3 * 2 * 14 * 14)
    a, b = _alternate(lambda: packed(x), lambda: plain(x), rounds, 20)
    return [_figure(f"patch embedding, {patches} patches, 1176 -> 512: prepacked / F.linear", a, b, "per image")]


def prefill_figure(rounds: int, model: str, prompt: int) -> list[Figure]:
    import torch

    from services.models import attention_kernel
    from services.models.demo import demo_model_path
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for
    from services.prefill.engine import PrefillEngine

    path = demo_model_path(model)
    lm = adapter_for(path).load_language(path, "cpu", "float32", 4096)
    prepack_language(lm, "auto", rows=(256, 1024), head_rows=(1, 16), fuse=True)
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    ids = torch.randint(0, 150000, (prompt,), generator=torch.Generator().manual_seed(3)).tolist()
    kernels = list(attention_kernel._LIB)
    firsts: dict[str, list[int]] = {"with": [], "without": []}

    def one(which: str) -> None:
        held = engine.submit(ids, greedy=True).result()
        firsts[which].append(held.first_tokens[0] if held.first_tokens is not None
                             else int(held.first_logits.argmax()))
        held.release()

    def without() -> None:
        attention_kernel._LIB.clear()
        try:
            one("without")
        finally:
            attention_kernel._LIB[:] = kernels

    try:
        a, b = _alternate(lambda: one("with"), without, rounds, 3)
    finally:
        engine.close()
    same = len(set(firsts["with"]) | set(firsts["without"])) == 1
    figure = _figure(f"prefill of a {prompt}-token prompt, {model} model: with the attention kernel / without", a, b,
                     f"per prompt; same first token: {same}")
    figure.detail["same_first_token"] = same
    return [figure]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 9)
    where = machine()
    figures = [*attention_figures(rounds, [117, 200] if args.quick else [117, 200, 512, 1024, 4096]),
               *patch_embed_figure(rounds, 256),
               *prefill_figure(rounds, "tiny" if args.quick else "medium", 117)]
    print_figures(figures, "prompt-stage kernels, each against what it replaces")
    write_json({"figures": figures, "machine": where}, results_dir(args.quick) / "prefill_kernels.json")
    if not args.quick and not args.no_docs:
        write_doc_block("prefill-kernels", "python -m benchmarks.prefill_kernels", figures)
    same = all(f.detail.get("same_first_token", True) for f in figures)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
