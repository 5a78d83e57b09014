"""A FAKE IPC opener: the shm store's device-tensor path (leases, reference counting, draining) tested on CPU.

FAKE, because no GPU is here: a "device" tensor shared by `share` is copied into a file of its own under /dev/shm
that stands for the producer's GPU allocation.  `open` maps that file by name in any process (as CUDA IPC maps the
producer's memory), and the file is unlinked when the producer's tensor is garbage collected, i.e. when the store
drops it, so `freed(desc)` tells a test exactly when the device memory would go back.  CPU reads are synchronous;
`hold_reads()` stands for a GPU whose queued reads have not completed: views closed meanwhile keep their leases
until `finish_reads()`.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from services.connectors.base import EntryMissing
from services.connectors.codec import dtype_name, torch_dtype
from services.connectors.ipc import IpcOpener, ReadsDone

PREFIX = "/dev/shm/epdfakeipc-"


class FakeIpc(IpcOpener):
    kind = "fake"

    def __init__(self) -> None:
        self.mapped = 0                 # tensors this process opened that are still alive
        self._reads = threading.Event()
        self._reads.set()
        self._lock = threading.Lock()

    def owns(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor)   # the test store holds only "device" tensors

    def empty(self, dtype: Any, shape: Sequence[int], device: Any) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def share(self, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        path = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        with open(path, "wb") as file:
            file.write(data or b"\0")
        weakref.finalize(tensor, _unlink, path)   # the producer's "free"
        return {"kind": self.kind, "name": name, "path": path, "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape), "nbytes": len(data)}

    def open(self, desc: dict[str, Any]) -> torch.Tensor:
        try:
            fd = os.open(desc["path"], os.O_RDWR)
        except FileNotFoundError:
            raise EntryMissing(f"FAKE device memory {desc['path']} is gone") from None
        try:
            mapping = mmap.mmap(fd, max(int(desc["nbytes"]), 1))
        finally:
            os.close(fd)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)[:int(desc["nbytes"])]
        tensor = flat.view(torch_dtype(desc["dtype"])).view(desc["shape"])
        with self._lock:
            self.mapped += 1
        weakref.finalize(tensor, self._unmapped)
        return tensor

    def _unmapped(self) -> None:
        with self._lock:
            self.mapped -= 1

    def reads_done(self, tensors: Sequence[torch.Tensor]) -> ReadsDone:
        if self._reads.is_set() or not tensors:
            return _done
        return self._reads.is_set

    def hold_reads(self) -> None:
        self._reads.clear()

    def finish_reads(self) -> None:
        self._reads.set()


def freed(desc: dict[str, Any]) -> bool:
    """The producer dropped the tensor `desc` describes (its FAKE device memory is gone)."""
    return not os.path.exists(desc["path"])


def _done() -> bool:
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
