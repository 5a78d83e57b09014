"""The prefix cache's keys: a hash chain over a prompt's fixed-size token blocks.

Block i's key hashes block i-1's key, the block's token ids, and the mm_hash
(and offset) of every multimodal item overlapping the block; the chain starts
from the request's cache_salt.  So a block is reused only when the whole
prefix up to and including it is the same tokens, the same images at the same
places, under the same salt: a different salt or a different image never
shares a block.  An item without an mm_hash makes its blocks and all later
ones uncacheable.  Only full blocks are cached.

The cached KV itself is the prompts' own pool blocks (kv_pool.py), shared by
reference and kept, least recently used first out, within the `--prefix-cache-mb`
budget by `BlockManager` (blocks.py); one cache serves one model (one engine).
"""

from __future__ import annotations

import hashlib
import struct

from services.models.base import MultiModalInput

BLOCK_SIZE = 16


def block_hashes(token_ids: list[int], mm_items: list[MultiModalInput], cache_salt: str | None,
                 block_size: int = BLOCK_SIZE, scope: str = "") -> list[bytes]:
    """Chain keys of the prompt's full blocks, stopping before the first block with an unhashed item.  `scope`
    (the weight version) starts the chain too: blocks of other weights are never reused."""
    seed = b"epd-prefix-v1\0" + (cache_salt or "").encode()
    parent = hashlib.sha256(seed + (b"\0" + scope.encode() if scope else b"")).digest()
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
