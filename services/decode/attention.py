"""Paged decode attention: one query token per row against that row's KV blocks.

`PagedAttention.__call__(q, k_pool, v_pool, tables, lens)` with q [B, Hq, D], one layer's pool
k/v [num_blocks, Hkv, block_size, D], tables [B, max_blocks] int32 and lens [B] int32 (tokens
each row attends to, its new one included) returns [B, Hq, D].  Its cost is proportional to
sum(lens), not B x max(lens).  Two implementations, chosen by measurement in
benchmarks/paged_attention.py (docs/benchmarks.md):

- "c": services/kernels/paged_attention.c, built at install (portable, AVX2 and AVX-512 variants,
  chosen by the CPU at run time) and called through ctypes on the tensors' data pointers; float32
  on CPU only; rows x kv-heads split over the torch thread count, on torch's
  OpenMP pool.
- "torch": rows grouped by block count; per group the blocks are gathered and one SDPA runs with
  a mask hiding the tail of the last block.  Any dtype and device (the CUDA path).

`select_attention("auto")` takes "c" where it builds and applies, else "torch".
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from services import kernels

logger = logging.getLogger(__name__)

KERNELS = ("auto", "c", "torch")


def build_kernel() -> Any:
    """The loaded C kernel (ctypes CDLL); raises OSError (KernelUnavailable) where none runs here."""
    lib = kernels.library("paged_attention")
    fn = lib.epd_paged_attention
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i32, i32, i32, i32, i32, f32, ptr, i32]
    fn.restype = i32
    return lib


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


class CPagedAttention:
    """The compiled kernel; float32 CPU tensors, contiguous."""

    name = "c"

    def __init__(self) -> None:
        self._fn = build_kernel().epd_paged_attention

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, num_blocks: list[int] | None = None) -> torch.Tensor:
        rows, heads, dim = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        status = self._fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(),
                          tables.stride(0), lens.data_ptr(), rows, heads, k_pool.shape[1], dim, k_pool.shape[2],
                          scale, out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise ValueError(f"paged attention kernel refused shapes q {tuple(q.shape)}, pool {tuple(k_pool.shape)}")
        return out

    @staticmethod
    def applies(dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (dtype == torch.float32 and device.type == "cpu" and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= 32 and head_dim <= 256)


def select_attention(kernel: str, dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> CPagedAttention | TorchPagedAttention:
    """The attention implementation for `kernel` ("auto" | "c" | "torch"); "auto" prefers "c"."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; supported: {', '.join(KERNELS)}")
    if kernel == "torch":
        return TorchPagedAttention()
    applies = CPagedAttention.applies(dtype, device, num_heads, num_kv_heads, head_dim)
    if kernel == "c" and not applies:
        raise ValueError(f"the C attention kernel needs float32 on CPU, got {dtype} on {device}")
    if applies:
        try:
            return CPagedAttention()
        except OSError as exc:
            if kernel == "c":
                raise
            logger.warning("%s; using the torch attention path", exc)
    return TorchPagedAttention()
