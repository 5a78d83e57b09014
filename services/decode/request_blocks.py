"""One request's share of the block pool: its reservation, its block table, its tokens in cache.

Made by `DecodeEngine.reserve` (in the serving thread, before the KV is read), filled once by
`load` straight from the connector's view (exactly one copy of the prompt KV into the blocks),
grown by the engine thread one token at a time (`append_slot`), and handed back by `release`
when the request ends, whatever the reason (idempotent).
"""

from __future__ import annotations

import threading

import torch

from services.decode.block_pool import BlockPool


class RequestBlocks:
    def __init__(self, pool: BlockPool, reserved: int) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.num_tokens = 0            # tokens whose K/V is in the blocks
        self.bytes_copied = 0          # bytes `load` copied in (the decode side of the hand-off)
        self._reserved = reserved      # blocks still promised to this request
        self._released = False
        self._lock = threading.Lock()

    @property
    def released(self) -> bool:
        return self._released

    def load(self, kv: torch.Tensor) -> None:
        """Copy a prefilled KV [num_layers, 2, num_kv_heads, L, head_dim] into fresh blocks: one copy (a KV on
        another device, say Redis's host copy for a CUDA pool, first crosses over whole)."""
        pool, size = self.pool, self.pool.block_size
        if kv.device != pool.kv.device:   # a blocking copy: the source (a store's buffer) may go right after
            kv = kv.to(pool.kv.device)
        length = kv.shape[3]
        count = pool.blocks_for(length)
        with self._lock:
            if self._released or self.blocks:
                raise RuntimeError("load() needs a fresh, unreleased reservation")
            self.blocks = pool.take(count)
            self._reserved -= count
        full = length // size
        layers, _, heads, _, dim = kv.shape
        if full:
            source = kv[:, :, :, :full * size].reshape(layers, 2, heads, full, size, dim).permute(0, 1, 3, 2, 4, 5)
            runs = _runs(self.blocks[:full])
            if len(runs) <= _MAX_RUNS or source.dtype != pool.kv.dtype:
                # consecutive block ids (the pool hands out low ids first) take one slice copy_ each, which
                # also widens a bfloat16 KV into float32 blocks in the same pass
                for offset, first, count in runs:
                    pool.blocks[:, :, first:first + count].copy_(source[:, :, offset:offset + count])
            else:
                pool.blocks[:, :, torch.tensor(self.blocks[:full], device=pool.kv.device)] = source
        if length > full * size:
            tail = pool.blocks[:, :, self.blocks[full]]
            tail[:, :, :, :length - full * size] = kv[:, :, :, full * size:]
            tail[:, :, :, length - full * size:] = 0   # never read by the C kernel; masked by the torch one
        self.num_tokens = length
        pool.count_tokens(length)
        self.bytes_copied += kv.numel() * kv.element_size()

    def append_slot(self) -> tuple[int, int, bool]:
        """Where the next token's K/V goes: (block id, offset in it, whether the block is new)."""
        offset = self.num_tokens % self.pool.block_size
        is_new = offset == 0
        if is_new:
            with self._lock:
                self.blocks.extend(self.pool.take(1))
                self._reserved -= 1
            self.pool.blocks[:, :, self.blocks[-1]] = 0
        self.num_tokens += 1
        self.pool.count_tokens(1)
        return self.blocks[-1], offset, is_new

    def truncate(self, num_tokens: int) -> None:
        """Forget the tokens past `num_tokens` (their blocks stay reserved for this request)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        keep = self.pool.blocks_for(num_tokens)
        with self._lock:
            extra, self.blocks = self.blocks[keep:], self.blocks[:keep]
            self._reserved += len(extra)
        self.pool.put_back(extra)
        self.pool.count_tokens(num_tokens - self.num_tokens)
        self.num_tokens = num_tokens

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            blocks, reserved, self.blocks, self._reserved = self.blocks, self._reserved, [], 0
        self.pool.give_back(blocks, reserved, self.num_tokens)


_MAX_RUNS = 8   # more runs of consecutive block ids than this: one indexed copy instead of a copy_ per run


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(offset in `ids`, first id, count) of each run of consecutive ascending ids."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for index in range(1, len(ids) + 1):
        if index == len(ids) or ids[index] != ids[index - 1] + 1:
            runs.append((start, ids[start], index - start))
            start = index
    return runs
