"""Paged decode attention: one query token per row against that row's KV blocks.

`PagedAttention.__call__(q, k_pool, v_pool, tables, lens)` with q [B, Hq, D], one layer's pool
k/v [num_blocks, Hkv, block_size, D], tables [B, max_blocks] int32 and lens [B] int32 (tokens
each row attends to, its new one included) returns [B, Hq, D].  Its cost is proportional to
sum(lens), not B x max(lens): rows grouped by block count, per group the blocks gathered and one
SDPA run with a mask hiding the tail of the last block; any dtype and device.  This is the eager
step's attention; the fused step (services/kernels/fused_step.c) has its own, per row over the blocks
(services/kernels/paged_attention.c, compiled into it).  A standalone C kernel for the eager step
was measured against this and deleted (docs/benchmarks.md, "Native kernels: kept or deleted").
"""

from __future__ import annotations

import torch


class TorchPagedAttention:
    """Gather each length group's blocks, one SDPA per group; exact for any dtype and device."""

    name = "torch"

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, num_blocks: list[int] | None = None) -> torch.Tensor:
        rows, heads, dim = q.shape
        kv_heads, block = k_pool.shape[1], k_pool.shape[2]
        counts = num_blocks if num_blocks is not None else [(int(n) + block - 1) // block for n in lens.tolist()]
        out = torch.empty_like(q)
        groups: dict[int, list[int]] = {}
        for row, count in enumerate(counts):
            groups.setdefault(count, []).append(row)
        for count, members in groups.items():
            index = torch.tensor(members, device=q.device)
            ids = tables[index, :count].long()                                   # [G, count]
            keys = k_pool[ids].permute(0, 2, 1, 3, 4).reshape(len(members), kv_heads, count * block, dim)
            values = v_pool[ids].permute(0, 2, 1, 3, 4).reshape(len(members), kv_heads, count * block, dim)
            columns = torch.arange(count * block, device=q.device)
            mask = columns[None, :] < lens[index].to(columns.dtype)[:, None]     # [G, L]
            # The query heads sharing a kv head become that head's "query positions": one SDPA over
            # [G, kv_heads, group, D] x [G, kv_heads, L, D], no K/V expansion for grouped heads.
            grouped = q[index].view(len(members), kv_heads, heads // kv_heads, dim)
            result = torch.nn.functional.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
            out[index] = result.reshape(len(members), heads, dim)
        return out
