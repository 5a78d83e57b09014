"""CUDA tensors across processes by CUDA IPC handle ("shared GPU memory"), encoded as plain JSON.

`share` turns a CUDA tensor into a JSON dict with torch's own IPC reduction (the same one torch.multiprocessing
queues use); `open` rebuilds a tensor on the same GPU memory in another process.  Only explicit fields travel,
never pickles.

Lifetime: the producer keeps the tensor in its pool entry until every consumer's lease is gone
(services/connectors/ipc_lease.py).  torch's own cross-process count (a counter set to 1 at each share, taken
down by each consumer's free, the block kept in a "limbo" while it is above 0) assumes exactly one consumer per
share: a handle opened by several consumers would free the block while one still reads it, and a handle
nobody opened would stay in limbo for the life of the process.  So `share` takes torch's count back to 0 at
once and the leases alone decide: when the producer drops the tensor, the caching allocator gets it back.

Ordering: `_share_cuda_` records an interprocess event on the producer's current stream, and a consumer's
current stream waits on it when it opens the handle, so a consumer never reads before the producer's writes.
A consumer's reads are asynchronous too: `reads_done` records an event on its stream when its view closes,
and its lease is given back once that event has completed (no host synchronisation on the read path).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import torch

from services.connectors.base import ConnectorError, EntryCorrupt, EntryMissing
from services.connectors.codec import dtype_name, torch_dtype
from services.connectors.ipc import IpcOpener, ReadsDone


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def _done() -> bool:
    return True


def share(name: str, t: torch.Tensor) -> dict[str, Any]:
    """JSON description of CUDA tensor `t` that another process on this host can open."""
    if not torch.cuda.is_available():
        raise ConnectorError("CUDA tensor given but CUDA is not available in this process")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t.detach())
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size, storage_offset,
     _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    if ref_handle is not None:   # the leases decide the lifetime, not torch's one-consumer count (module docstring)
        torch.UntypedStorage._release_ipc_counter_cuda(ref_handle, ref_offset)
    return {"kind": CudaIpc.kind, "name": name, "dtype": dtype_name(dtype), "shape": list(size),
            "stride": list(stride), "tensor_offset": offset, "device": int(device), "handle": _b64(handle),
            "storage_size": storage_size, "storage_offset": storage_offset,
            "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": ref_offset,
            "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync),
            "nbytes": t.numel() * t.element_size()}


def open_shared(d: dict[str, Any]) -> torch.Tensor:
    """The tensor `share` described, mapped from the producer's GPU memory (no copy)."""
    if not torch.cuda.is_available():
        raise ConnectorError(f"entry holds CUDA tensor {d.get('name')!r} but CUDA is not available here")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(d["shape"]), tuple(d["stride"]), int(d["tensor_offset"]),
            torch.storage.TypedStorage, torch_dtype(d["dtype"]), int(d["device"]), _unb64(d["handle"]),
            int(d["storage_size"]), int(d["storage_offset"]), False, _unb64(d["ref_counter_handle"]),
            int(d["ref_counter_offset"]), _unb64(d["event_handle"]), bool(d["event_sync_required"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise EntryCorrupt(f"malformed CUDA IPC description: {exc!r}") from None
    except RuntimeError as exc:  # the producer's memory is gone or not reachable from this process
        raise EntryMissing(f"cannot open CUDA tensor {d.get('name')!r}: {exc}") from None


class CudaIpc(IpcOpener):
    kind = "cuda"

    def owns(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.is_cuda

    def empty(self, dtype: Any, shape: Sequence[int], device: Any) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def share(self, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        return share(name, tensor)

    def open(self, desc: dict[str, Any]) -> torch.Tensor:
        return open_shared(desc)

    def reads_done(self, tensors: Sequence[torch.Tensor]) -> ReadsDone:
        if not tensors:
            return _done
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensors[0].device))
        return event.query
