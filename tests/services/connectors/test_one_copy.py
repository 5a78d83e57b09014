"""One copy per hop: put_into fills the store's own memory, views copy nothing, and the counters say so.

shm: `fill` gets views of the pool segment (data pointers inside the mapping), the entry is readable only
after fill returns, and a reader's view() sees the very bytes fill wrote (same addresses).  redis: `fill`
writes into the buffer that is sent.  StoreStats.bytes_copied counts exactly the payload bytes each
operation copies; a scrape (stats()) never waits while a fill is running.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

KV_SPEC = {"kv": (torch.float32, (2, 2, 3, 17, 8))}
NBYTES = 2 * 2 * 3 * 17 * 8 * 4


def _fill_from(source: torch.Tensor, seen: dict):
    def fill(views):
        seen["ptr"] = views["kv"].data_ptr()
        views["kv"].copy_(source)
    return fill


def test_shm_put_into_writes_in_place_and_readers_view_the_same_bytes(make_store):
    producer, consumer = make_store("shm", purpose="kv"), make_store("shm", purpose="kv", suffix="c",
                                                                      preallocate=False)
    source = torch.randn(*KV_SPEC["kv"][1])
    seen: dict = {}
    handle = producer.put_into("req|a", KV_SPEC, _fill_from(source, seen))
    segment = producer._pool.segment.buf  # the pool mapping itself
    base = segment.ctypes.data
    assert base <= seen["ptr"] < base + segment.nbytes  # fill wrote straight into shared memory
    with consumer.view(handle) as views:  # another store: its own mapping of the same segment
        mapping = consumer._reader._segments[producer.segment][0].buf
        # the same offset in the segment: the reader views the very bytes fill wrote
        assert views["kv"].data_ptr() - mapping.ctypes.data == seen["ptr"] - base
        assert torch.equal(views["kv"], source)
    assert producer.stats().bytes_copied == NBYTES  # the fill, once
    assert consumer.stats().bytes_copied == 0       # views copy nothing
    assert torch.equal(consumer.get(handle)["kv"], source)
    assert consumer.stats().bytes_copied == NBYTES  # get copies out once


def test_shm_entry_is_not_visible_until_filled_and_a_failed_fill_leaves_nothing(make_store):
    store = make_store("shm", purpose="kv")
    looked: list = []

    def fill(views):
        looked.append(store.lookup("req|b"))
        raise RuntimeError("producer failed mid-copy")

    with pytest.raises(RuntimeError):
        store.put_into("req|b", KV_SPEC, fill)
    assert looked == [None] and store.lookup("req|b") is None
    stats = store.stats()
    assert (stats.entries, stats.bytes_used, stats.bytes_copied) == (0, 0, 0)


@pytest.mark.parametrize("backend", ["shm", "redis"])
def test_put_counts_one_copy_in_for_shm_and_none_for_redis(make_store, backend):
    store = make_store(backend, purpose="mm")
    arrays = {"pixel_values": np.arange(64 * 1176, dtype=np.float32).reshape(64, 1176),
              "image_grid_thw": np.array([[1, 8, 8]], dtype=np.int64)}
    handle = store.put("m|h", arrays)  # numpy in (torch-free producers), torch out
    with store.view(handle) as views:
        assert np.array_equal(views["pixel_values"].numpy(), arrays["pixel_values"])
        assert views["image_grid_thw"].tolist() == [[1, 8, 8]]
    payload = arrays["pixel_values"].nbytes + arrays["image_grid_thw"].nbytes
    assert store.stats().bytes_copied == (payload if backend == "shm" else 0)  # redis sends from the arrays


def test_redis_put_into_fills_the_buffer_that_is_sent(make_store):
    store = make_store("redis", purpose="kv")
    source = torch.randn(*KV_SPEC["kv"][1])
    handle = store.put_into("req|c", KV_SPEC, _fill_from(source, {}))
    assert store.stats().bytes_copied == NBYTES
    assert torch.equal(store.get(handle)["kv"], source)
    assert store.stats().bytes_copied == NBYTES  # received straight into the tensors' buffer


@pytest.mark.parametrize("backend", ["shm", "redis"])
def test_stats_never_wait_for_a_fill(make_store, backend):
    store = make_store(backend, purpose="kv")
    filling, release = threading.Event(), threading.Event()

    def slow_fill(views):
        filling.set()
        release.wait(5)
        views["kv"].zero_()

    writer = threading.Thread(target=store.put_into, args=("req|d", KV_SPEC, slow_fill))
    writer.start()
    try:
        assert filling.wait(5)
        started = time.perf_counter()
        store.stats()
        store.lookup("other")
        assert time.perf_counter() - started < 0.5
    finally:
        release.set()
        writer.join(5)
    assert store.lookup("req|d") is not None
