"""CUDA tensors through the shm store by CUDA IPC handle; runs only where CUDA is available."""

from __future__ import annotations

import json

import pytest
import torch

from services.connectors import EntryMissing
from tests.services.connectors.helpers import digest, run_child

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHILD_GET = """
store = create_store(StoreConfig("shm", "kv", sys.argv[2], preallocate=False))
got = store.get(json.loads(sys.argv[1]))
assert got["kv"].is_cuda and got["ids"].device.type == "cpu"
print(digest(got))
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
