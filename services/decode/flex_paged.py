"""Paged decode attention with torch's flex_attention: each row reads only its own KV blocks, in place.

The pool is heads-major (services/decode/block_pool.py `heads_major`): one layer's keys of one KV head are one
run of `(num_blocks + 1) x block_size` tokens, so keys and values go to flex_attention as [1, Hkv, N, D] views
of the pool, shared by every row (flex broadcasts a key batch of 1), and the query of row b is batch b:
[B, Hq, 1, D].  Nothing is gathered: the block mask tells the kernel which blocks of the pool each row reads.

- `kv_num_blocks[b]` = ceil(lens[b] / block_size) and `kv_indices[b]` = row b's block table, as is (a view
  of the step's device tables): the kernel visits exactly those blocks, in table order;
- `mask_mod(b, h, q, kv)` is the whole truth, not only the tail: the kv position's block p must belong to row b
  (`row_of[p] == b`) at a logical position under lens[b] (`idx_of[p] * block_size + kv % block_size`).  The
  compiled kernel evaluates it on the visited blocks (it masks the last block's tail); the eager reference
  evaluates it everywhere, so the same mask gives the same answer on both: that is what tests check on CPU.
  A decode block belongs to one request only (prefix sharing is prefill's), so one owner per block suffices.
- padding rows of a CUDA graph bucket (rows count..bucket-1) read the scratch block's first token only, the
  one their own K/V was written to (`b >= count`).

Why flex rather than SDPA: SDPA takes one dense K/V per row, so paged KV would have to be gathered per step
(the CPU "torch" path does that); flex reads the pool through the block table, exactly, and its decoding kernel
(Triton, compiled by Inductor on CUDA) splits each row's blocks across the SMs.  On CUDA it must be compiled
(eager flex materializes [B, Hq, 1, N] scores over the whole pool); on CPU it runs eagerly (tests, the
gpu_check dry run).  `row_of` / `idx_of` are rebuilt in place every step from the tables, inside the step's
CUDA graph: the mask never leaves the GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 128   # flex's query tile: one decode query per row fits one


class PagedMask:
    """The block masks of one decoder's steps, one per batch bucket, over static device buffers."""

    def __init__(self, num_pool_blocks: int, block_size: int, tables: torch.Tensor, lens: torch.Tensor,
                 count: torch.Tensor, scratch_block: int) -> None:
        device = tables.device
        self.block_size, self.scratch_block = block_size, scratch_block
        self.tables, self.lens, self.count = tables, lens, count   # the step's device buffers, written per step
        max_rows, max_blocks = tables.shape
        self.num_tokens = num_pool_blocks * block_size
        self._dummy = num_pool_blocks          # where table entries past a row's blocks scatter to
        self.row_of = torch.full((num_pool_blocks + 1,), -1, dtype=torch.int32, device=device)
        self.idx_of = torch.zeros(num_pool_blocks + 1, dtype=torch.int32, device=device)
        self.num_blocks = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._columns = torch.arange(max_blocks, dtype=torch.int32, device=device)
        self._rows = torch.arange(max_rows, dtype=torch.int32, device=device)
        self._masks: dict[int, BlockMask] = {}

    def mask_mod(self) -> Callable[..., torch.Tensor]:
        row_of, idx_of, lens, count = self.row_of, self.idx_of, self.lens, self.count
        size, scratch_start = self.block_size, self.scratch_block * self.block_size

        def paged(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            block = kv // size
            own = (row_of[block] == b) & (idx_of[block] * size + kv % size < lens[b])
            return own | ((b >= count[0]) & (kv == scratch_start))

        return paged

    def for_rows(self, rows: int) -> BlockMask:
        """The block mask of a step of `rows` rows (made once per bucket: views of the static buffers)."""
        mask = self._masks.get(rows)
        if mask is None:
            width = self.tables.shape[1]
            mask = BlockMask.from_kv_blocks(self.num_blocks[:rows].view(rows, 1, 1),
                                            self.tables[:rows].view(rows, 1, 1, width),
                                            BLOCK_SIZE=(Q_BLOCK, self.block_size), mask_mod=self.mask_mod(),
                                            seq_lengths=(1, self.num_tokens), compute_q_blocks=False)
            self._masks[rows] = mask
        return mask

    def update(self, rows: int) -> None:
        """Rebuild the per-block owner tables from the first `rows` rows' tables and lengths (device ops only)."""
        lens, tables = self.lens[:rows], self.tables[:rows]
        counts = self.num_blocks[:rows]
        torch.div(lens + (self.block_size - 1), self.block_size, rounding_mode="floor", out=counts)
        width = tables.shape[1]
        valid = self._columns[None, :] < counts[:, None]
        target = torch.where(valid, tables, self._dummy).long().flatten()
        self.row_of.fill_(-1)
        self.row_of.scatter_(0, target, self._rows[:rows, None].expand(rows, width).flatten())
        self.idx_of.scatter_(0, target, self._columns[None, :].expand(rows, width).flatten())


def flex_function(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention compiled for CUDA (one graph per batch bucket, static shapes); eager elsewhere."""
    if device.type != "cuda":
        return _eager
    import torch._dynamo

    # a graph per bucket and per model in one process (the gpu check builds several): never fall back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    return _compiled()


_COMPILED: list[Any] = []


def _compiled() -> Callable[..., torch.Tensor]:
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, dynamic=False, fullgraph=True))
    return _COMPILED[0]


def _eager(*args: Any, **kwargs: Any) -> torch.Tensor:
    with warnings.catch_warnings():   # "without torch.compile ... materializes the full scores": meant, off CUDA
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(*args, **kwargs)


def attend(flex: Callable[..., torch.Tensor], q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: BlockMask, scale: float) -> torch.Tensor:
    """q [B, Hq, D] against one layer's pool keys/values [Hkv, blocks, block_size, D]: [B, Hq, D]."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    k = keys.view(1, kv_heads, -1, dim)
    v = values.view(1, kv_heads, -1, dim)
    out = flex(q.view(rows, heads, 1, dim), k, v, block_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    return out.view(rows, heads, dim)
