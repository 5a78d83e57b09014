"""redis backend against a real redis-server."""

from __future__ import annotations

import json
import time

import pytest
import redis
import torch

from services.connectors import BackendUnavailable, ConnectorError, EntryCorrupt, EntryMissing
from tests.services.connectors.helpers import assert_same, digest, read_json_line, sample_tensors, start_child


def test_round_trip_exact(make_store):
    store = make_store("redis", capacity_bytes=64 << 20)
    tensors = sample_tensors()
    handle = store.put("k", tensors)
    assert json.loads(json.dumps(handle)) == handle
    assert_same(store.get(handle), tensors)
    big = {"a": torch.randn(9 << 18), "b": torch.randn(5, 1000).to(torch.bfloat16), "c": torch.arange(3)}
    handle = store.put("big", big)  # 9 MiB: several pieces on the wire
    assert_same(store.get(handle), big)
    with store.view(handle) as views:
        assert_same(views, big)


def test_lookup_finds_entries_of_any_producer(make_store):
    store, other = make_store("redis"), make_store("redis", suffix="o")
    assert store.lookup("k") is None
    many = {f"t{i}": torch.full((2,), float(i)) for i in range(80)}  # header longer than one lookup read
    handle = store.put("k", many)
    assert store.lookup("k") == handle
    assert other.lookup("k") == handle
    assert_same(other.get(other.lookup("k")), many)
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts, stats.entries) == (1, 1, 1, 1)


def test_cross_process_both_ways(make_store, redis_proc, instance):
    store = make_store("redis")
    tensors = sample_tensors(5)
    body = """
store = create_store(StoreConfig("redis", "ec", "child", redis_url=sys.argv[2], namespace=sys.argv[3]))
print(json.dumps({"digest": digest(store.get(json.loads(sys.argv[1])))}), flush=True)
print(json.dumps(store.put("theirs", sample_tensors(8))), flush=True)
sys.stdin.readline()
store.close()
"""
    child = start_child(body, json.dumps(store.put("mine", tensors)), redis_proc.url, instance)
    try:
        assert read_json_line(child)["digest"] == digest(tensors)
        theirs = read_json_line(child)
        assert digest(store.get(theirs)) == digest(sample_tensors(8))
        child.stdin.write("exit\n")
        child.stdin.close()
        assert child.wait(timeout=30) == 0
        with pytest.raises(EntryMissing):  # its close() deleted what it wrote
            store.get(theirs)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_capacity_evicts_least_recently_used(make_store):
    store = make_store("redis", capacity_bytes=1 << 20)
    block = 200 * 1024
    handles = {i: store.put(f"k{i}", {"x": torch.full((block // 4,), float(i))}) for i in range(8)}
    stats = store.stats()
    assert stats.bytes_used <= 1 << 20 and stats.evictions >= 3
    with pytest.raises(EntryMissing):
        store.get(handles[0])
    assert store.lookup("k0") is None
    assert torch.equal(store.get(handles[7])["x"], torch.full((block // 4,), 7.0))
    with pytest.raises(ConnectorError, match="capacity"):
        store.put("huge", {"x": torch.zeros(1 << 20)})


def test_ttl_expiry(make_store):
    store = make_store("redis", ttl_s=0.3)
    handle = store.put("k", {"x": torch.ones(4)})
    assert_same(store.get(handle), {"x": torch.ones(4)})
    time.sleep(0.45)
    with pytest.raises(EntryMissing):
        store.get(handle)
    assert store.lookup("k") is None
    assert store.stats().entries == 0


def test_damaged_values_are_corrupt(make_store, redis_proc):
    store = make_store("redis")
    raw = redis.Redis.from_url(redis_proc.url)
    handle = store.put("k", {"x": torch.randn(1000)})
    raw.setrange(handle["redis_key"], handle["head_length"] + 100, b"\x00\x01\x02")
    with pytest.raises(EntryCorrupt, match="checksum"):
        store.get(handle)
    handle = store.put("k", {"x": torch.randn(1000)})
    rkey = handle["redis_key"]
    raw.set(rkey, raw.getrange(rkey, 0, handle["head_length"] + 99), keepttl=True)
    with pytest.raises(EntryCorrupt, match="bytes"):  # truncated
        store.get(handle)
    handle = store.put("k", {"x": torch.randn(1000)})
    with pytest.raises(EntryCorrupt, match="does not match"):
        store.get({**handle, "tensors": [{**handle["tensors"][0], "shape": [500, 2]}]})
    raw.delete(handle["redis_key"])
    raw.lpush(handle["redis_key"], b"x")
    with pytest.raises(EntryCorrupt):
        store.get(handle)
    raw.delete(handle["redis_key"])


def test_overwrite_and_release(make_store):
    store = make_store("redis", purpose="kv")
    old = store.put("k", {"x": torch.zeros(3)})
    new = store.put("k", {"x": torch.ones(3)})
    with pytest.raises(EntryMissing, match="overwritten"):
        store.get(old)
    store.release(old)  # names an older write: must not delete the new one
    assert_same(store.get(new), {"x": torch.ones(3)})
    store.release(new)
    with pytest.raises(EntryMissing):
        store.get(new)
    assert store.stats().entries == 0


def test_redis_down_then_back(make_store, own_redis):
    store = make_store("redis", redis_url=own_redis.url)
    handle = store.put("k", {"x": torch.ones(3)})
    own_redis.stop()
    for call in (lambda: store.get(handle), lambda: store.put("k2", {"x": torch.ones(3)}),
                 lambda: store.lookup("k")):
        start = time.monotonic()
        with pytest.raises(BackendUnavailable, match="unavailable"):
            call()
        assert time.monotonic() - start < 3.0
    own_redis.start()  # same port, empty: old entries are gone, new ones work without a new client
    with pytest.raises(EntryMissing):
        store.get(handle)
    handle = store.put("k", {"x": torch.arange(5)})
    assert_same(store.get(handle), {"x": torch.arange(5)})
    assert store.lookup("k") == handle


def test_values_past_one_write_argument_are_appended(make_store, monkeypatch):
    from services.connectors import redis_format

    monkeypatch.setattr(redis_format, "WRITE_ARG_BYTES", 1 << 20)  # SET + APPENDs without a 64 MiB test value
    store = make_store("redis", capacity_bytes=16 << 20)
    tensors = {"a": torch.randn(300_000), "b": torch.arange(200_001), "c": torch.randn(7).to(torch.bfloat16)}
    handle = store.put("k", tensors)
    assert handle["head_length"] + handle["length"] > 2 << 20
    assert_same(store.get(handle), tensors)


def test_close_deletes_what_it_wrote(make_store, redis_proc, instance):
    store = make_store("redis")
    for i in range(5):
        store.put(f"k{i}", {"x": torch.ones(10)})
    raw = redis.Redis.from_url(redis_proc.url)
    assert len(raw.keys(f"{instance}:*")) == 5
    assert 0 < raw.pttl(f"{instance}:ec:k0") <= 600_000  # every key carries the TTL
    store.close()
    store.close()  # idempotent
    assert raw.keys(f"{instance}:*") == []
