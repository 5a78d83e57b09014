"""The tensor-store contract shared by the EC and KV connectors.

A producer (encode for EC, prefill for KV) calls `put(key, tensors)` and sends
the returned handle, a small JSON-serializable dict, to a consumer (prefill for
EC, decode for KV), which calls `get(handle)` or `view(handle)` in its own
process.  `lookup(key)` is the producer-side cache check (the EC store doubles
as the encoder cache).  Every store is bounded in bytes, evicts the least
recently used entry, expires entries after `ttl_s` and verifies what it loads:
a missing entry raises `EntryMissing`, a damaged one `EntryCorrupt`, an
unreachable backend `BackendUnavailable`; never a hang, never a wrong tensor.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PURPOSES = ("ec", "kv", "mm")
# Names end up in /dev/shm file names and Redis keys: keep them to a safe alphabet.
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")


class ConnectorError(Exception):
    """Base of every error a tensor store raises."""


class EntryMissing(ConnectorError):
    """The entry is not stored: never written, evicted, expired, released or its segment is gone."""


class EntryCorrupt(ConnectorError):
    """The entry or the handle does not match: header, dtype, shape, length or checksum."""


class BackendUnavailable(ConnectorError):
    """The backend cannot be reached or refuses to serve (e.g. Redis down, out of memory)."""


@dataclass(frozen=True)
class StoreConfig:
    """Where and how a store keeps its tensors; validated at construction."""

    backend: str
    """Registered backend name: "shm" or "redis"."""
    purpose: str
    """"ec" (encoder outputs), "kv" (KV cache) or "mm" (multimodal inputs: render's processed items);
    part of every shm/redis name."""
    instance_id: str
    """Unique per process instance; part of every shm/redis name so instances never collide."""
    capacity_bytes: int = 1 << 30
    """Upper bound of bytes held; least recently used entries are evicted beyond it."""
    ttl_s: float = 600.0
    """Entries older than this are expired."""
    redis_url: str | None = None
    """redis://host:port/db; required for the redis backend."""
    namespace: str = "epd"
    """Prefix of Redis keys and shm segment names."""
    verify_checksum: bool | None = None
    """Compute and check a crc32 of the payload; None means the backend default (shm off, redis on)."""
    preallocate: bool = True
    """shm: create and pre-fault the pool at construction; False defers it to the first put (consumers)."""

    def __post_init__(self) -> None:
        if self.purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, got {self.purpose!r}")
        if not _INSTANCE_RE.match(self.instance_id):
            raise ValueError(f"instance_id must match {_INSTANCE_RE.pattern}, got {self.instance_id!r}")
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {self.namespace!r}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("the redis backend needs redis_url (e.g. redis://localhost:6379/0)")


@dataclass
class StoreStats:
    """Counters of one store; bytes_used and entries are what this store holds now."""

    bytes_used: int
    entries: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    puts: int
    bytes_copied: int = 0
    """Payload bytes this store copied: into its memory (put, and what put_into's fill writes) and out of
    it (get); zero-copy views count nothing.  The copy-count tests and /metrics read it."""


TensorSpec = tuple[Any, tuple[int, ...]]
"""(torch.dtype, shape) of one tensor that `TensorStore.put_into` reserves."""


def check_key(key: str) -> str:
    """Keys are non-empty strings; raise ValueError otherwise (a caller bug, not a store error)."""
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise ValueError(f"a store key must be a non-empty string of at most 1024 characters, got {key!r}")
    return key


class TensorStore(ABC):
    """Named groups of tensors under a key; a small JSON-serializable handle loads them from any process
    that reaches the backend."""

    backend: str
    local: bool = False
    """Every operation touches only this host's memory (no I/O, no waiting on another process): a small one
    may run on an event loop instead of paying two thread hand-offs (`services.connectors.wiring.run_op`)."""

    @abstractmethod
    def put(self, key: str, tensors: dict[str, Any]) -> dict[str, Any]:
        """Store `tensors` (each in its own dtype) under `key`, replacing any entry; return the handle.

        Values are torch tensors or numpy arrays (torch-free producers, render and the coordinator, put
        multimodal inputs as numpy); readers always get torch tensors back."""

    def put_into(self, key: str, specs: dict[str, TensorSpec], fill: Callable[[dict[str, torch.Tensor]], None]
                 ) -> dict[str, Any]:
        """Store tensors written in place: reserve one tensor per spec, let `fill` write every element
        (the producer's one copy, e.g. from its KV blocks), publish them under `key`; return the handle.

        Backends override this to hand `fill` views of their own memory (shm: the pool segment) so the
        entry costs exactly one copy; this default fills fresh tensors and then calls `put` (two)."""
        import torch

        tensors = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in specs.items()}
        fill(tensors)
        return self.put(key, tensors)

    @abstractmethod
    def lookup(self, key: str) -> dict[str, Any] | None:
        """The handle of a valid entry for `key`, or None; counts a hit or a miss."""

    @abstractmethod
    def get(self, handle: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Verified tensors owned by the caller (one copy out); works in any process given the handle."""

    @contextmanager
    def view(self, handle: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
        """Read without copying where the backend allows; the default copies through get()."""
        yield self.get(handle)

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Drop the entry for `key`; True if this store held one."""

    def release(self, handle: dict[str, Any]) -> None:  # noqa: B027 - optional hook, no-op by default
        """The consumer is done with a one-shot entry (KV); the producer may free it."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """Current counters."""

    @abstractmethod
    def close(self) -> None:
        """Free everything this store owns (shm segments, Redis keys it wrote). Idempotent."""

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
