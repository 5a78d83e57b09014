"""CUDA tensors through the shm store by CUDA IPC handle; runs only where CUDA is available (scripts/gpu_check.sh).

The lease logic itself is tested on CPU with a FAKE opener (test_ipc_leases.py); these check the real one: torch's
own one-consumer count is taken out of the way, so an entry read by two processes, or by none, gives its GPU
memory back exactly when the last lease goes.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.connectors import EntryMissing
from tests.services.connectors.helpers import digest, read_json_line, run_child, start_child

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHILD_GET = """
store = create_store(StoreConfig("shm", "kv", sys.argv[2], preallocate=False))
got = store.get(json.loads(sys.argv[1]))
assert got["kv"].is_cuda and got["ids"].device.type == "cpu"
print(digest(got))
"""

CHILD_GET_KV = """
store = create_store(StoreConfig("shm", "kv", sys.argv[2], preallocate=False))
got = store.get(json.loads(sys.argv[1]))
assert got["kv"].is_cuda
print(digest(got))
"""

CHILD_HOLD = """
store = create_store(StoreConfig("shm", "kv", sys.argv[2], preallocate=False))
with store.view(json.loads(sys.argv[1])) as views:
    print(json.dumps({"sum": float(views["kv"].float().sum())}), flush=True)
    sys.stdin.readline()
print(json.dumps({"closed": True}), flush=True)
sys.stdin.readline()
"""


def test_cuda_tensor_travels_by_ipc_handle(make_store, instance):
    store = make_store("shm", purpose="kv")
    tensors = {"kv": torch.randn(4, 128, device="cuda").to(torch.bfloat16), "ids": torch.arange(4)}
    handle = store.put("r1", tensors)
    assert [d["name"] for d in handle["cuda"]] == ["kv"] and json.dumps(handle)
    assert store.stats().bytes_used >= 4 * 128 * 2  # the kept GPU tensor counts against the capacity
    assert digest(store.get(handle)) == digest(tensors)
    assert run_child(CHILD_GET, json.dumps(handle), instance + "c").strip() == digest(tensors)
    store.release(handle)
    with pytest.raises(EntryMissing):
        store.get(handle)


def _tell(child) -> None:
    child.stdin.write("\n")
    child.stdin.flush()


def test_two_consumers_of_one_entry_and_its_memory_back_after_the_last(make_store, instance):
    store = make_store("shm", purpose="kv", capacity_bytes=64 << 20)
    numel = 1 << 20
    before = torch.cuda.memory_allocated()
    handle = store.put("r", {"kv": torch.ones(numel, device="cuda")})
    held = torch.cuda.memory_allocated()
    assert held - before == 4 * numel
    readers = [start_child(CHILD_HOLD, json.dumps(handle), f"{instance}c{i}") for i in range(2)]
    try:
        for reader in readers:
            assert read_json_line(reader) == {"sum": float(numel)}
        store.delete("r")
        store.stats()
        assert torch.cuda.memory_allocated() == held        # both still read it
        _tell(readers[0])
        assert read_json_line(readers[0]) == {"closed": True}
        store.stats()
        assert torch.cuda.memory_allocated() == held        # the second still does
        _tell(readers[1])
        assert read_json_line(readers[1]) == {"closed": True}
        store.stats()
        assert torch.cuda.memory_allocated() == before      # back, not parked in torch's IPC limbo
    finally:
        for reader in readers:
            reader.kill()
            reader.wait(timeout=10)


def test_an_entry_nobody_opened_gives_its_memory_back_when_freed(make_store):
    store = make_store("shm", purpose="kv", capacity_bytes=64 << 20)
    before = torch.cuda.memory_allocated()
    store.put("r", {"kv": torch.ones(1 << 20, device="cuda")})
    store.delete("r")
    assert torch.cuda.memory_allocated() == before


def test_put_into_a_cuda_spec_fills_gpu_memory_another_process_reads(make_store, instance):
    store = make_store("shm", purpose="kv", capacity_bytes=64 << 20)
    want = {"kv": torch.arange(24, dtype=torch.float32, device="cuda").view(2, 3, 4)}
    handle = store.put_into("k", {"kv": (torch.float32, (2, 3, 4), "cuda:0")},
                            lambda views: views["kv"].copy_(want["kv"]))
    assert handle["length"] == 0 and [d["name"] for d in handle["cuda"]] == ["kv"]
    got = run_child(CHILD_GET_KV, json.dumps(handle), instance + "c")
    assert got.strip() == digest(want)
