"""A prefix cache of prompt KV in fixed-size blocks, keyed by a hash chain.

Block i's key hashes block i-1's key, the block's token ids, and the mm_hash
(and offset) of every multimodal item overlapping the block; the chain starts
from the request's cache_salt.  So a block is reused only when the whole
prefix up to and including it is the same tokens, the same images at the same
places, under the same salt: a different salt or a different image never
shares a block.  An item without an mm_hash makes its blocks and all later
ones uncacheable.  Only full blocks are cached.  Entries are evicted least
recently used beyond `max_blocks`.

Blocks hold [num_layers, 2, num_kv_heads, block_size, head_dim] in the model
dtype; one cache serves one model (the owner keeps it per engine).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from services.models.base import MultiModalInput

if TYPE_CHECKING:
    import torch

BLOCK_SIZE = 16


def block_hashes(token_ids: list[int], mm_items: list[MultiModalInput], cache_salt: str | None,
                 block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Chain keys of the prompt's full blocks, stopping before the first block with an unhashed item."""
    parent = hashlib.sha256(b"epd-prefix-v1\0" + (cache_salt or "").encode()).digest()
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        overlapping = [item for item in mm_items
                       if item.offset < start + block_size and start < item.offset + item.length]
        if any(item.mm_hash is None for item in overlapping):
            break
        digest = hashlib.sha256(parent)
        digest.update(struct.pack(f"<{block_size}q", *token_ids[start:start + block_size]))
        for item in sorted(overlapping, key=lambda item: item.offset):
            digest.update(f"\0{item.modality}\0{item.offset}\0{item.mm_hash}".encode())
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """LRU map from block key to block KV; thread-safe."""

    def __init__(self, max_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if max_blocks <= 0 or block_size <= 0:
            raise ValueError("max_blocks and block_size must be positive")
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.num_queried_blocks = 0
        self.num_hit_blocks = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, keys: list[bytes]) -> list[torch.Tensor]:
        """KV of the longest run of leading keys that are all cached (each marked recently used)."""
        hits: list[torch.Tensor] = []
        with self._lock:
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                self._blocks.move_to_end(key)
                hits.append(block)
            self.num_queried_blocks += len(keys)
            self.num_hit_blocks += len(hits)
        return hits

    def insert(self, keys: list[bytes], kv: torch.Tensor, first: int = 0) -> None:
        """Store blocks `first..len(keys)-1` of a prompt's KV ([layers, 2, heads, L, head_dim])."""
        with self._lock:
            for index in range(first, len(keys)):
                rows = slice(index * self.block_size, (index + 1) * self.block_size)
                self._blocks[keys[index]] = kv[:, :, :, rows].clone()
                self._blocks.move_to_end(keys[index])
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
