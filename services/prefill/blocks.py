"""Who holds which KV block: reference counts, the free list and the prefix cache's index.

Every block of the pool (kv_pool.py) is in exactly one of three states:

- *referenced*: one or more prompts use it (`refs[block] > 0`); a prefix-cache hit adds a
  reference to a block another prompt filled: blocks are shared, never copied;
- *cached*: no prompt uses it but it carries a prefix key, so a later prompt with the same
  prefix can take it back; cached blocks form an LRU bounded by `max_cached_blocks` (the
  `--prefix-cache-mb` budget), the least recently used is dropped first;
- *free*: no prompt, no key.

`allocate` takes free blocks first, then evicts cached ones (LRU); it takes nothing and
returns None when even that is not enough (the caller waits for a release).  `publish` gives a
block that a prompt has completely filled its key, so later lookups find it; a key already
published keeps its first block (the second stays private to its prompt and is freed with it).
Thread-safe: the engine's worker allocates and publishes, request threads release.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque


class BlockManager:
    def __init__(self, num_blocks: int, max_cached_blocks: int) -> None:
        if num_blocks < 1 or max_cached_blocks < 0:
            raise ValueError(f"need num_blocks >= 1 and max_cached_blocks >= 0, got {num_blocks}, "
                             f"{max_cached_blocks}")
        self.num_blocks, self.max_cached_blocks = num_blocks, max_cached_blocks
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, bytes] = OrderedDict()   # unreferenced keyed blocks, LRU first
        self._index: dict[bytes, int] = {}                      # key -> block (referenced or cached)
        self._key_of: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.num_evicted_blocks = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` could hand out now (free + cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their prefix."""
        return len(self._cached)

    @property
    def num_indexed(self) -> int:
        """Blocks a lookup can find (cached + referenced ones with a key)."""
        return len(self._index)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks of the longest run of leading `keys` that are indexed; each gains a reference."""
        hits: list[int] = []
        with self._lock:
            for key in keys:
                block = self._index.get(key)
                if block is None:
                    break
                self._cached.pop(block, None)
                self._refs[block] += 1
                hits.append(block)
        return hits

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, each with one reference, or None (nothing taken) if the pool cannot give them."""
        with self._lock:
            if count > len(self._free) + len(self._cached):
                return None
            taken = []
            for _ in range(count):
                block = self._free.pop() if self._free else self._evict_oldest()  # LIFO: warm pages first
                self._refs[block] = 1
                taken.append(block)
            return taken

    def publish(self, key: bytes, block: int) -> None:
        """`block` (referenced, completely filled) holds the prefix `key`: later lookups may share it."""
        with self._lock:
            if self._refs[block] < 1:
                raise ValueError(f"block {block} is not referenced: only a prompt's own block can be published")
            if key in self._index or block in self._key_of:
                return
            self._index[key] = block
            self._key_of[block] = key

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; unreferenced keyed blocks become cached, the rest free."""
        with self._lock:
            for block in blocks:
                if self._refs[block] < 1:
                    raise ValueError(f"block {block} released more often than referenced")
                self._refs[block] -= 1
                if self._refs[block]:
                    continue
                if block in self._key_of:
                    self._cached[block] = self._key_of[block]
                else:
                    self._free.append(block)
            while len(self._cached) > self.max_cached_blocks:
                self._free.append(self._evict_oldest())

    def _evict_oldest(self) -> int:
        block, key = self._cached.popitem(last=False)
        del self._index[key], self._key_of[block]
        self.num_evicted_blocks += 1
        return block
