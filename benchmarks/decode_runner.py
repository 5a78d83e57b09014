"""The decode role's model in a `DecodeRunner` with rows of random KV, for the decode benchmarks (fused_step,
head_screen, linear_kernels, panel_ref, int8_screen)."""

from __future__ import annotations

from typing import Any

MODELS = {"tiny": "demo", "smollm2": "smollm2", "medium": "demo-medium", "deep": "demo-deep"}


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
    runner = DecodeRunner(lm, pool, rows, context + 8, Sampler(0))
    kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, context, layout.head_dim, generator=
                     torch.Generator().manual_seed(0))
    seqs = []
    for row in range(rows):
        assert pool.try_reserve(per_row)
        seqs.append(RequestBlocks(pool, per_row))
        seqs[-1].load(kv)
        runner.place(row, seqs[-1])
    return runner, seqs
