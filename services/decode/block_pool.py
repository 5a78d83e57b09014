"""The decode KV block pool: one allocation sized in bytes, handed out in fixed-size blocks.

Layout: `kv` [num_layers, 2 (k/v), num_blocks, num_kv_heads, block_size, head_dim] in the
model dtype, so `kv[layer, 0]` is one layer's keys for every block, contiguous (what the
CPU attention kernels read).  `heads_major=True` (the CUDA step, services/decode/gpu_runner.py)
swaps the two: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim], so one layer's keys
of one head are one run of tokens that flex attention reads as a sequence.  `blocks` views either
in the first order; whatever writes blocks (services/decode/request_blocks.py) goes through it.
A request owns a list of block ids (its block table).

Budget (the policy, docs/architecture.md): admission *reserves* the blocks a request can ever
need, ceil((prompt_len + max_tokens) / block_size); blocks are *taken* from the free list only
when tokens land in them (the prompt at admission, one more each time decode crosses a block
boundary).  So memory held = tokens held rounded up to a block per request, and a request that
was admitted never runs dry mid-decode: the pool cannot be over-promised.  Running requests,
requests waiting for a batch row, and requests whose KV is being copied in all count in the
same budget; a request that does not fit waits at admission (bounded) or is refused (429).

Thread-safe: the serving threads reserve and load, the engine thread grows and frees.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from services.models.base import KVLayout


class PoolExhausted(RuntimeError):
    """A reservation was overdrawn (a bug: reservations make this impossible)."""


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    used_blocks: int        # blocks holding tokens
    reserved_blocks: int    # promised to admitted requests, not yet holding tokens
    block_size: int
    block_bytes: int        # bytes of one block, all layers, keys and values
    tokens_held: int        # tokens whose K/V the used blocks hold

    @property
    def bytes_held(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def held_ratio(self) -> float:
        """bytes held / (tokens held x bytes per token): 1.0 is no waste; paging keeps it near 1."""
        per_token = self.block_bytes // self.block_size
        return self.bytes_held / (self.tokens_held * per_token) if self.tokens_held else 1.0

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks - self.reserved_blocks


def block_bytes(layout: KVLayout, block_size: int) -> int:
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    return layout.num_layers * 2 * layout.num_kv_heads * block_size * layout.head_dim * itemsize


class BlockPool:
    def __init__(self, layout: KVLayout, capacity_bytes: int, block_size: int = 16, device: str | torch.device = "cpu",
                 heads_major: bool = False) -> None:
        if block_size < 1 or block_size > 256:
            raise ValueError(f"block_size must be in [1, 256], got {block_size}")
        self.layout, self.block_size = layout, block_size
        self.block_bytes = block_bytes(layout, block_size)
        self.num_blocks = capacity_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"a KV pool of {capacity_bytes} bytes holds no block of {self.block_bytes} bytes")
        self.scratch_block = self.num_blocks      # never handed out (module docstring)
        blocks, heads = self.num_blocks + 1, layout.num_kv_heads
        shape = (layout.num_layers, 2, *((heads, blocks) if heads_major else (blocks, heads)), block_size,
                 layout.head_dim)
        # CPU: empty, not zeros: zeros would touch (make resident) every page now; a block is zeroed when taken.
        # Heads-major (the flex step): zeros, since flex reads masked positions too (0 x NaN garbage is NaN): the
        # scratch block of a CUDA step's padding rows, and every block where flex runs eagerly (CPU, the tests).
        self.kv = (torch.zeros if heads_major else torch.empty)(shape, dtype=layout.dtype, device=device)
        self.heads_major = heads_major
        self.blocks = self.kv.transpose(2, 3) if heads_major else self.kv   # [layers, 2, block, head, token, dim]
        self._free = list(range(self.num_blocks - 1, -1, -1))   # a stack: pop() gives low ids first
        self._reserved = 0
        self._tokens = 0   # tokens held in taken blocks, all requests
        self._lock = threading.Lock()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def try_reserve(self, num_blocks: int) -> bool:
        """Promise `num_blocks` to one request if the pool can keep the promise."""
        with self._lock:
            if num_blocks > len(self._free) - self._reserved:
                return False
            self._reserved += num_blocks
            return True

    def take(self, count: int) -> list[int]:
        """Turn `count` reserved blocks into blocks holding tokens."""
        with self._lock:
            if count > self._reserved or count > len(self._free):
                raise PoolExhausted(f"taking {count} blocks, {self._reserved} reserved, {len(self._free)} free")
            self._reserved -= count
            return [self._free.pop() for _ in range(count)]

    def give_back(self, blocks: list[int], unused_reservation: int, num_tokens: int) -> None:
        """A request ended: its blocks and what is left of its reservation return to the pool."""
        with self._lock:
            self._free.extend(reversed(blocks))
            self._reserved -= unused_reservation
            self._tokens -= num_tokens

    def put_back(self, blocks: list[int]) -> None:
        """Blocks a request no longer fills go back to the free list, still reserved for it."""
        with self._lock:
            self._free.extend(reversed(blocks))
            self._reserved += len(blocks)

    def count_tokens(self, delta: int) -> None:
        with self._lock:
            self._tokens += delta

    def stats(self) -> PoolStats:
        with self._lock:
            used = self.num_blocks - len(self._free)
            return PoolStats(self.num_blocks, used, self._reserved, self.block_size, self.block_bytes, self._tokens)
