"""BlockManager: references, sharing by key, the LRU bound of unreferenced blocks, a full pool."""

from __future__ import annotations

import pytest

from services.prefill.blocks import BlockManager


def test_allocate_and_release_without_keys_frees_everything():
    manager = BlockManager(num_blocks=4, max_cached_blocks=2)
    blocks = manager.allocate(3)
    assert blocks is not None and len(set(blocks)) == 3 and manager.num_free == 1
    assert [manager.refs(b) for b in blocks] == [1, 1, 1]
    manager.release(blocks)
    assert manager.num_free == 4 and manager.num_cached == 0


def test_a_full_pool_gives_nothing_and_takes_nothing():
    manager = BlockManager(num_blocks=4, max_cached_blocks=0)
    held = manager.allocate(3)
    assert manager.allocate(2) is None and manager.num_free == 1
    manager.release(held)
    assert manager.allocate(4) is not None


def test_published_blocks_are_shared_by_reference():
    manager = BlockManager(num_blocks=8, max_cached_blocks=8)
    first = manager.allocate(3)
    manager.publish(b"a", first[0])
    manager.publish(b"b", first[1])
    assert manager.lookup([b"a", b"b", b"c"]) == first[:2]  # the same blocks, not copies
    assert manager.refs(first[0]) == manager.refs(first[1]) == 2 and manager.refs(first[2]) == 1
    manager.release(first)
    assert manager.num_cached == 0  # still referenced by the second prompt
    manager.release(first[:2])
    assert manager.num_cached == 2 and manager.num_free == 8
    assert manager.lookup([b"a"]) == first[:1] and manager.num_cached == 1  # taken back out of the LRU


def test_only_max_cached_unreferenced_blocks_are_kept_lru_first_out():
    manager = BlockManager(num_blocks=8, max_cached_blocks=2)
    blocks = manager.allocate(3)
    for key, block in zip((b"x", b"y", b"z"), blocks, strict=True):
        manager.publish(key, block)
    manager.release([blocks[2]])
    manager.release([blocks[0]])
    manager.release([blocks[1]])  # release order: z, x, y  -> z is least recently used
    assert manager.num_cached == 2 and manager.num_evicted_blocks == 1
    assert manager.lookup([b"z"]) == [] and manager.lookup([b"x"]) == [blocks[0]]


def test_allocation_evicts_cached_blocks_when_free_ones_run_out():
    manager = BlockManager(num_blocks=3, max_cached_blocks=3)
    blocks = manager.allocate(3)
    manager.publish(b"k", blocks[0])
    manager.release(blocks)
    assert manager.allocate(3) is not None and manager.num_indexed == 0


def test_a_key_keeps_its_first_block():
    manager = BlockManager(num_blocks=4, max_cached_blocks=4)
    first, second = manager.allocate(1), manager.allocate(1)
    manager.publish(b"k", first[0])
    manager.publish(b"k", second[0])  # a concurrent prompt with the same prefix: stays private
    manager.release(second)
    assert manager.num_cached == 0 and manager.lookup([b"k"]) == first


def test_misuse_is_refused():
    manager = BlockManager(num_blocks=2, max_cached_blocks=1)
    [block] = manager.allocate(1)
    manager.release([block])
    with pytest.raises(ValueError, match="released more often"):
        manager.release([block])
    with pytest.raises(ValueError, match="not referenced"):
        manager.publish(b"k", block)
