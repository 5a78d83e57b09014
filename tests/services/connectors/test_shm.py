"""shm backend in one process; a second store instance plays the consumer (same path as a remote one)."""

from __future__ import annotations

import glob
import json
import threading
import time

import pytest
import torch

from services.connectors import ConnectorError, EntryCorrupt, EntryMissing
from services.connectors.shm_layout import Layout
from tests.services.connectors.helpers import assert_same, sample_tensors


def test_round_trip_exact(make_store):
    producer, consumer = make_store("shm"), make_store("shm", suffix="c", preallocate=False)
    tensors = sample_tensors()
    handle = producer.put("k", tensors)
    assert json.loads(json.dumps(handle)) == handle
    assert_same(consumer.get(handle), tensors)
    assert_same(producer.get(handle), tensors)
    got = consumer.get(handle)
    got["emb"].add_(1)  # owned: writing it leaves the store alone
    assert_same(consumer.get(handle), tensors)


def test_view_is_zero_copy_and_checked_on_exit(make_store):
    store = make_store("shm")
    tensors = {"x": torch.arange(1000, dtype=torch.float32)}
    handle = store.put("k", tensors)
    with store.view(handle) as views:
        first = views["x"].data_ptr()
        assert torch.equal(views["x"], tensors["x"])
    with store.view(handle) as views:
        assert views["x"].data_ptr() == first
    with pytest.raises(EntryMissing):
        with store.view(handle) as views:
            store.put("k", {"x": torch.zeros(10)})  # overwritten while viewed
    with pytest.raises(EntryMissing):
        store.get(handle)


def test_lookup_counts_hits_and_misses(make_store):
    store = make_store("shm")
    assert store.lookup("k") is None
    handle = store.put("k", {"x": torch.ones(3)})
    assert store.lookup("k") == handle
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts, stats.entries) == (1, 1, 1, 1)
    assert store.delete("k") and not store.delete("k")
    assert store.lookup("k") is None


def test_capacity_evicts_least_recently_used(make_store):
    store = make_store("shm", capacity_bytes=1 << 20)
    block = 200 * 1024
    handles = {f"k{i}": store.put(f"k{i}", {"x": torch.full((block // 4,), float(i))}) for i in range(4)}
    store.lookup("k0")  # now most recently used
    for i in range(4, 8):
        handles[f"k{i}"] = store.put(f"k{i}", {"x": torch.full((block // 4,), float(i))})
        assert store.stats().bytes_used <= 1 << 20
    assert store.lookup("k1") is None
    with pytest.raises(EntryMissing):
        store.get(handles["k1"])
    assert store.lookup("k0") is not None
    assert torch.equal(store.get(handles["k7"])["x"], torch.full((block // 4,), 7.0))
    stats = store.stats()
    assert stats.evictions >= 3 and stats.bytes_used <= stats.capacity_bytes


def test_entry_larger_than_capacity_is_refused(make_store):
    store = make_store("shm", capacity_bytes=64 * 1024)
    with pytest.raises(ConnectorError, match="capacity"):
        store.put("big", {"x": torch.zeros(64 * 1024)})


def test_ttl_expiry(make_store):
    producer, consumer = make_store("shm", ttl_s=0.3), make_store("shm", suffix="c", preallocate=False)
    handle = producer.put("k", {"x": torch.ones(4)})
    assert_same(consumer.get(handle), {"x": torch.ones(4)})
    time.sleep(0.4)
    with pytest.raises(EntryMissing, match="expired"):
        consumer.get(handle)
    assert producer.lookup("k") is None
    assert producer.stats().bytes_used == 0


def _payload(store, handle):
    seg = store._pool.segment  # the test flips bytes where another process could
    return seg.buf[handle["offset"]: handle["offset"] + handle["length"]]


def test_checksum_catches_flipped_payload(make_store):
    producer = make_store("shm", verify_checksum=True)
    consumer = make_store("shm", suffix="c", preallocate=False, verify_checksum=True)
    handle = producer.put("k", {"x": torch.randn(100)})
    assert handle["checksum"] is not None
    _payload(producer, handle)[17] ^= 0xFF
    with pytest.raises(EntryCorrupt, match="checksum"):
        consumer.get(handle)


def test_header_changes_are_detected(make_store):
    producer, consumer = make_store("shm"), make_store("shm", suffix="c", preallocate=False)
    handle = producer.put("k", {"x": torch.randn(10)})
    with pytest.raises(EntryMissing):  # a generation the slot does not hold
        consumer.get({**handle, "generation": handle["generation"] + 1})
    with pytest.raises(EntryCorrupt):  # right generation, wrong key
        consumer.get({**handle, "key": "other"})
    with pytest.raises(EntryCorrupt):
        consumer.get({**handle, "tensors": [{**handle["tensors"][0], "dtype": "float64"}]})
    with pytest.raises(EntryMissing, match="gone"):
        consumer.get({**handle, "segment": handle["segment"] + "x"})
    with pytest.raises(EntryCorrupt, match="malformed"):
        consumer.get({k: v for k, v in handle.items() if k != "slot"})
    layout = Layout.read_header(producer._pool.segment.mm)
    producer._pool.segment.buf[layout.slot_at(handle["slot"])] ^= 0xFF  # garbage magic
    with pytest.raises(EntryCorrupt, match="damaged"):
        consumer.get(handle)


def test_release_frees_one_shot_entries(make_store):
    producer = make_store("shm", purpose="kv", capacity_bytes=1 << 20)
    consumer = make_store("shm", purpose="kv", suffix="c", preallocate=False)
    a = producer.put("a", {"x": torch.ones(1000)})
    b = producer.put("b", {"x": torch.ones(1000)})
    producer.release(a)  # producer side: freed at once
    assert producer.lookup("a") is None
    consumer.release(b)  # consumer side: marked consumed, freed by the producer when it next looks
    assert producer.stats().entries == 0
    with pytest.raises(EntryMissing):
        consumer.get(b)


def test_overwrite_replaces_entry(make_store):
    store = make_store("shm")
    old = store.put("k", {"x": torch.zeros(5)})
    new = store.put("k", {"x": torch.ones(7)})
    assert_same(store.get(new), {"x": torch.ones(7)})
    with pytest.raises(EntryMissing):
        store.get(old)
    assert store.stats().entries == 1


def test_close_unlinks_and_consumers_see_missing(make_store, instance):
    producer, consumer = make_store("shm"), make_store("shm", suffix="c", preallocate=False)
    handle = producer.put("k", {"x": torch.ones(3)})
    consumer.get(handle)
    assert glob.glob(f"/dev/shm/*{instance}*") == [f"/dev/shm/{producer.segment}"]
    producer.close()
    producer.close()  # idempotent
    assert glob.glob(f"/dev/shm/*{instance}*") == []
    with pytest.raises(EntryMissing, match="gone"):
        consumer.get(handle)
    with pytest.raises(ConnectorError):
        producer.put("k", {"x": torch.ones(3)})


def test_lazy_pool_and_duplicate_instance(make_store, instance):
    lazy = make_store("shm", preallocate=False)
    assert glob.glob(f"/dev/shm/*{instance}*") == []
    lazy.put("k", {"x": torch.ones(2)})
    with pytest.raises(ConnectorError, match="unique"):
        make_store("shm")  # same name in the same process


def test_reads_racing_evictions_never_return_wrong_data(make_store):
    """A reader racing evictions and reuse of the space gets the right tensor or EntryMissing."""
    producer = make_store("shm", capacity_bytes=1 << 20)
    consumer = make_store("shm", suffix="c", preallocate=False)
    numel = (192 << 10) // 4
    written: list[tuple[int, dict]] = []
    done = threading.Event()

    def write() -> None:
        for i in range(400):
            written.append((i, producer.put(f"k{i % 7}", {"x": torch.full((numel,), float(i))})))
        done.set()

    outcomes = {"ok": 0, "missing": 0}
    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 60
    while (not done.is_set() or not outcomes["ok"]) and time.monotonic() < deadline:
        if not written:
            continue
        i, handle = written[max(0, len(written) - 4)]
        try:
            got = consumer.get(handle)["x"]
        except EntryMissing:
            outcomes["missing"] += 1
            continue
        assert torch.all(got == float(i)), f"handle of put {i} returned other data"
        outcomes["ok"] += 1
    writer.join(timeout=60)
    assert outcomes["ok"] > 0, outcomes
