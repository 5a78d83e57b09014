"""How device tensors travel between processes of one host: by handle, never through the pool's bytes.

The shm store (services/connectors/shm.py) hands a device tensor over by an opener's handle: `share` turns it
into a small JSON description (with the opener's `kind`), `open` maps it in another process without a copy.
The producer keeps the tensor alive in its pool entry; consumers hold a lease while they read it
(services/connectors/ipc_lease.py), so the producer frees it only when every consumer is done.

`CudaIpc` (services/connectors/cuda_ipc.py) is the real one: CUDA IPC memory handles, one GPU's memory shared
by the roles on it.  Tests use a FAKE opener over shared files (tests/services/connectors/fake_ipc.py): the same
store, leases and reference counting, run on CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ReadsDone = Callable[[], bool]
"""A probe: True once the reads a consumer queued on opened tensors have completed (a GPU reads asynchronously:
its lease must outlive them)."""


class IpcOpener(ABC):
    kind: str
    """Written into every description; a store opens only descriptions of its own kind."""

    @abstractmethod
    def owns(self, tensor: Any) -> bool:
        """`tensor` travels by handle (a device tensor) rather than through the pool's bytes."""

    @abstractmethod
    def empty(self, dtype: Any, shape: Sequence[int], device: Any) -> torch.Tensor:
        """A tensor a producer fills in place (put_into) before it is shared."""

    @abstractmethod
    def share(self, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        """A JSON-serializable description of `tensor` that `open` maps in another process of this host."""

    @abstractmethod
    def open(self, desc: dict[str, Any]) -> torch.Tensor:
        """The tensor `desc` describes, on the producer's memory (no copy).  EntryMissing when that memory cannot
        be reached, EntryCorrupt for a malformed description."""

    @abstractmethod
    def reads_done(self, tensors: Sequence[torch.Tensor]) -> ReadsDone:
        """A probe for the reads this process queued on `tensors` so far (called when its view closes)."""
