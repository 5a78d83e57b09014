"""CUDA tensors across processes by CUDA IPC handle ("shared GPU memory"), encoded as plain JSON.

`share` turns a CUDA tensor into a JSON dict with torch's own IPC reduction
(the same one torch.multiprocessing queues use); `open_shared` rebuilds a
tensor on the same GPU memory in another process.  The producer must keep the
tensor alive until consumers are done: the shm store keeps it in the entry
until release(), TTL or eviction.  Only explicit fields travel, never pickles.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from services.connectors.base import ConnectorError, EntryCorrupt, EntryMissing
from services.connectors.codec import dtype_name, torch_dtype


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def share(name: str, t: torch.Tensor) -> dict[str, Any]:
    """JSON description of CUDA tensor `t` that another process on this host can open."""
    if not torch.cuda.is_available():
        raise ConnectorError("CUDA tensor given but CUDA is not available in this process")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t.detach())
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size, storage_offset,
     _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return {"name": name, "dtype": dtype_name(dtype), "shape": list(size), "stride": list(stride),
            "tensor_offset": offset, "device": int(device), "handle": _b64(handle),
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
