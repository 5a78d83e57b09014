"""Device tensors by IPC handle: leases count the consumers; memory goes when the last one is done or dies.

The shm store with the FAKE opener (fake_ipc.py: "device" memory is a file the producer owns), real consumer
processes for the cross-process cases, real kernel locks (services/connectors/ipc_lease.py).
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from services.connectors import EntryCorrupt, EntryMissing, StoreConfig
from services.connectors.base import ConnectorError
from services.connectors.ipc_lease import is_leased
from services.connectors.shm import ShmTensorStore
from tests.services.connectors.fake_ipc import FakeIpc, freed
from tests.services.connectors.helpers import read_json_line, start_child

CONSUMER = """
import torch
from services.connectors.shm import ShmTensorStore
from tests.services.connectors.fake_ipc import FakeIpc
store = ShmTensorStore(StoreConfig("shm", "ec", sys.argv[2], preallocate=False), ipc=FakeIpc())
with store.view(json.loads(sys.argv[1])) as views:
    print(json.dumps({"sum": float(views["emb"].sum())}), flush=True)
    sys.stdin.readline()   # hold the view until told
print(json.dumps({"closed": True}), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def stores(instance):
    made: list[ShmTensorStore] = []

    def make(suffix: str, producer: bool = True, capacity: int = 4 << 20, ipc: FakeIpc | None = None
             ) -> ShmTensorStore:
        config = StoreConfig("shm", "ec", instance + suffix, capacity_bytes=capacity, preallocate=producer)
        store = ShmTensorStore(config, ipc=ipc or FakeIpc())
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def _put(store: ShmTensorStore, key: str = "e", value: float = 1.0, numel: int = 1000) -> dict:
    """A handle to a "device" tensor the store alone keeps (the caller's reference is gone)."""
    return store.put(key, {"emb": torch.full((numel,), value)})


def _leased(store: ShmTensorStore, handle: dict) -> bool:
    pool = store._ensure_pool()
    return is_leased(pool.segment.fd, handle["slot"])


def _consumer(handle: dict, instance: str):
    child = start_child(CONSUMER, json.dumps(handle), instance)
    assert read_json_line(child) == {"sum": 1000.0}
    return child


def _tell(child) -> None:
    child.stdin.write("\n")
    child.stdin.flush()


def test_an_entry_two_consumers_read_is_freed_when_the_last_of_them_is_done(stores, instance):
    producer = stores("p")
    handle = _put(producer)
    [desc] = handle["cuda"]
    assert desc["kind"] == "fake" and handle["length"] == 0   # nothing went through the pool's bytes
    first, second = _consumer(handle, instance + "c1"), _consumer(handle, instance + "c2")
    try:
        assert producer.delete("e")
        assert producer.lookup("e") is None            # gone for lookups and new readers at once
        producer.stats()
        assert not freed(desc) and producer._pool.num_draining == 1
        _tell(first)
        assert read_json_line(first) == {"closed": True}
        producer.stats()
        assert not freed(desc) and _leased(producer, handle)   # the second still reads it
        _tell(second)
        assert read_json_line(second) == {"closed": True}
        producer.stats()                                # reclaim: no lease left
        assert freed(desc) and producer._pool.num_draining == 0
        assert producer.stats().bytes_used == 0
    finally:
        for child in (first, second):
            child.kill()
            child.wait(timeout=10)


def test_a_consumer_killed_while_it_reads_lets_the_entry_go(stores, instance):
    producer = stores("p")
    handle = _put(producer)
    child = _consumer(handle, instance + "c")
    producer.delete("e")
    producer.stats()
    assert not freed(handle["cuda"][0])
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    producer.stats()        # the kernel dropped the dead reader's lock
    assert freed(handle["cuda"][0]) and producer.stats().bytes_used == 0


def test_a_released_kv_entry_waits_for_its_readers_then_goes(stores):
    producer, ipc = stores("p"), FakeIpc()
    consumer = stores("c", producer=False, ipc=ipc)
    handle = _put(producer)
    with consumer.view(handle) as views:
        assert float(views["emb"].sum()) == 1000.0 and ipc.mapped == 1
        consumer.release(handle)     # decode's release: consumed, but this view still reads it
        producer.stats()
        assert not freed(handle["cuda"][0])
        del views
    producer.stats()
    assert freed(handle["cuda"][0]) and ipc.mapped == 0   # the consumer holds no mapping either


def test_views_in_one_process_share_one_lease_and_it_outlives_reads_still_queued(stores):
    producer, ipc = stores("p"), FakeIpc()
    consumer = stores("c", producer=False, ipc=ipc)
    handle = _put(producer)
    leases = consumer._reader.leases
    with consumer.view(handle), consumer.view(handle):
        assert leases.held(handle["segment"], handle["slot"]) == 2 and _leased(producer, handle)
    assert leases.held(handle["segment"], handle["slot"]) == 0 and not _leased(producer, handle)
    ipc.hold_reads()                 # a GPU whose copy out of the entry has not finished
    with consumer.view(handle):
        pass
    producer.delete("e")
    producer.stats()
    assert _leased(producer, handle) and not freed(handle["cuda"][0])
    ipc.finish_reads()
    assert leases.reap() == 0
    producer.stats()
    assert freed(handle["cuda"][0])


def test_a_reader_after_the_free_finds_it_missing_and_holds_nothing(stores):
    producer, ipc = stores("p"), FakeIpc()
    consumer = stores("c", producer=False, ipc=ipc)
    handle = _put(producer)
    producer.delete("e")
    producer.stats()
    assert freed(handle["cuda"][0])   # nobody held it: freed at once
    with pytest.raises(EntryMissing), consumer.view(handle):
        pass
    assert consumer._reader.leases.held(handle["segment"], handle["slot"]) == 0 and ipc.mapped == 0


def test_a_store_whose_freed_entries_are_all_still_read_refuses_a_put(stores):
    producer = stores("p", capacity=8192)
    consumer = stores("c", producer=False)
    handle = _put(producer, numel=1500)       # 6000 of 8192 bytes
    with consumer.view(handle):
        with pytest.raises(ConnectorError, match="still read by consumers"):
            _put(producer, key="f", numel=1500)   # evicts the first, which is still read: no room, no wait
    assert _put(producer, key="f", numel=1500)["key"] == "f"   # once the reader is done


def test_put_into_a_device_spec_hands_the_tensor_over_by_handle(stores):
    producer = stores("p")
    consumer = stores("c", producer=False)

    def fill(views: dict) -> None:
        views["kv"].copy_(torch.arange(12, dtype=torch.float32).view(3, 4))

    handle = producer.put_into("k", {"kv": (torch.float32, (3, 4), "fake:0")}, fill)
    assert handle["length"] == 0 and [d["name"] for d in handle["cuda"]] == ["kv"]
    assert torch.equal(consumer.get(handle)["kv"], torch.arange(12, dtype=torch.float32).view(3, 4))


def test_a_handle_of_another_opener_kind_is_refused(stores, instance):
    producer = stores("p")
    handle = _put(producer)
    handle["cuda"][0]["kind"] = "cuda"
    consumer = stores("c", producer=False)
    with pytest.raises(EntryCorrupt, match="holds \\['cuda'\\] device tensors; this store opens fake"):
        with consumer.view(handle):
            pass


def test_the_consumers_lease_descriptor_closes_with_its_last_lease(stores):
    producer = stores("p")
    consumer = stores("c", producer=False)
    handle = _put(producer)
    with consumer.view(handle):
        pass   # attached now (a mapping keeps a descriptor of its own)
    before = _descriptors(handle["segment"])
    with consumer.view(handle):
        assert _descriptors(handle["segment"]) == before + 1   # the lease's
    assert _descriptors(handle["segment"]) == before   # no descriptor (and no lock) left behind


def _descriptors(segment: str) -> int:
    return sum(1 for fd in os.listdir("/proc/self/fd") if segment in os.path.realpath(f"/proc/self/fd/{fd}"))
