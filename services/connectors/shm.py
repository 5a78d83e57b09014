"""The shm backend: tensors in a POSIX shared-memory pool on this host; CUDA tensors by IPC handle.

Producer: one pool segment per store, created once (at construction unless
`preallocate=False`), pre-faulted and reused (shm_pool).  Consumer: any process
on the host loads by handle through cached attachments (shm_reader).  A handle:

    {"backend": "shm", "key", "segment", "slot", "generation", "offset", "length",
     "checksum": crc32 | None, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}],
     "cuda": [CUDA IPC descriptions, see cuda_ipc]}

close() (also run at exit or when the store is collected) unlinks the segment.

Copies: `put` copies each tensor (torch or numpy) into the pool once;
`put_into` hands `fill` views of the reserved extent, so the producer's own
copy is the only one; `view` copies nothing; `get` copies out once.  Every
byte the store moves (or hands to `fill` to write) counts in
`StoreStats.bytes_copied`.  The store lock guards the pool's bookkeeping only:
it is never held while payload bytes are copied, so a metrics scrape
(`stats()`) or another put never waits for a copy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from services.connectors.base import (
    ConnectorError,
    StoreConfig,
    StoreStats,
    TensorSpec,
    TensorStore,
    check_key,
)
from services.connectors.codec import Data, copy_into, is_array, plan, plan_specs, tensor_at
from services.connectors.shm_pool import PoolEntry, ShmPool
from services.connectors.shm_reader import ShmReader, ShmRef
from services.connectors.shm_segment import segment_name

if TYPE_CHECKING:
    import torch


class ShmTensorStore(TensorStore):
    backend = "shm"
    local = True  # the pool segment and the index are this host's memory

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._name = segment_name(config.namespace, config.purpose, config.instance_id)
        self._reader = ShmReader(bool(config.verify_checksum))
        self._pool: ShmPool | None = None
        self._lock = threading.RLock()
        self._hits = self._misses = self._puts = self._copied = 0
        self._closed = False
        self._finalizers = [weakref.finalize(self, self._reader.close)]
        if config.preallocate:
            self._ensure_pool()

    @property
    def segment(self) -> str:
        """Name of this store's pool segment under /dev/shm."""
        return self._name

    def _ensure_pool(self) -> ShmPool:
        if self._pool is None:
            if self._closed:
                raise ConnectorError(f"shm store {self._name} is closed")
            self._pool = ShmPool(self._name, self.config.capacity_bytes, self.config.ttl_s,
                                 bool(self.config.verify_checksum))
            # Runs on close(), on garbage collection or at interpreter exit, whichever comes first.
            self._finalizers.append(weakref.finalize(self, self._pool.close))
        return self._pool

    def put(self, key: str, tensors: dict[str, Data]) -> dict[str, Any]:
        check_key(key)
        host = {n: t for n, t in tensors.items() if is_array(t) or t.device.type == "cpu"}
        gpu = {n: t for n, t in tensors.items() if not is_array(t) and t.is_cuda}
        if len(host) + len(gpu) != len(tensors):
            raise ConnectorError(f"entry {key!r}: only CPU and CUDA tensors can be stored")
        cuda = [_share_cuda(n, t) for n, t in gpu.items()]
        specs, length = plan(host)
        entry = self._reserve(key, specs, length, sum(d["nbytes"] for d in cuda), list(gpu.values()))
        return self._fill_and_publish(entry, cuda, lambda buf: self._copy_in(buf, entry, host))

    def put_into(self, key: str, specs: dict[str, TensorSpec],
                 fill: Callable[[dict[str, torch.Tensor]], None]) -> dict[str, Any]:
        """One copy: `fill` writes straight into views of the reserved pool extent (not yet readable)."""
        check_key(key)
        planned, length = plan_specs(specs)
        return self._fill_views(self._reserve(key, planned, length), fill)

    def _fill_views(self, entry: PoolEntry, fill: Callable[[dict[str, torch.Tensor]], None]) -> dict[str, Any]:
        """`fill` writes into views of the reserved extent, then the entry is published; its handle."""
        def fill_views(buf: Any) -> int:
            fill({s.name: tensor_at(buf, s, entry.offset) for s in entry.specs})
            return entry.length

        return self._fill_and_publish(entry, [], fill_views)

    def _reserve(self, key: str, specs: list[Any], length: int, extra: int = 0,
                 keep: list[Any] | None = None) -> PoolEntry:
        with self._lock:
            return self._ensure_pool().reserve(key, specs, length, extra, keep)

    def _fill_and_publish(self, entry: PoolEntry, cuda: list[dict[str, Any]],
                          fill: Callable[[Any], int]) -> dict[str, Any]:
        pool = self._ensure_pool()
        try:
            copied = fill(pool.segment.buf)  # outside the lock: readers reject the WRITING slot meanwhile
        except BaseException:
            with self._lock:
                pool.abort(entry)
            raise
        with self._lock:
            entry.cuda = cuda
            pool.publish(entry)
            self._puts += 1
            self._copied += copied
            return self._handle(entry, cuda)

    @staticmethod
    def _copy_in(buf: Any, entry: PoolEntry, tensors: dict[str, Data]) -> int:
        return sum(copy_into(buf, spec, entry.offset, t) for spec, t in zip(entry.specs, tensors.values(),
                                                                            strict=True))

    def _handle(self, entry: PoolEntry, cuda: list[dict[str, Any]]) -> dict[str, Any]:
        return {"backend": "shm", "key": entry.key, "segment": self._name, "slot": entry.slot,
                "generation": entry.gen, "offset": entry.offset, "length": entry.length,
                "checksum": entry.crc, "tensors": [s.to_dict() for s in entry.specs], "cuda": cuda}

    def lookup(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._pool.find(check_key(key)) if self._pool else None
            if entry is None:
                self._misses += 1
                return None
            self._hits += 1
            return self._handle(entry, entry.cuda)

    def get(self, handle: dict[str, Any]) -> dict[str, torch.Tensor]:
        # Copy inside the view so the closing check covers the copies (an eviction during them raises).
        with self.view(handle) as views:
            out = {name: t.clone() for name, t in views.items()}
        with self._lock:
            self._copied += sum(t.numel() * t.element_size() for t in out.values())
        return out

    @contextmanager
    def view(self, handle: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
        ref = self._ref(handle)
        with self._reader.view(ref) as views:
            yield {**views, **self._open_cuda(ref)}

    def _ref(self, handle: dict[str, Any]) -> ShmRef:
        if self._closed:
            raise ConnectorError(f"shm store {self._name} is closed")
        return ShmRef.from_handle(handle)

    def _open_cuda(self, ref: ShmRef) -> dict[str, torch.Tensor]:
        if not ref.cuda:
            return {}
        with self._lock:
            entry = self._pool.entry_for(ref.slot, ref.gen) if self._pool and self._is_own(ref) else None
        if entry is not None:  # a process cannot open its own IPC handles: use the tensors it keeps
            return dict(zip((d["name"] for d in ref.cuda), entry.keep, strict=True))
        from services.connectors.cuda_ipc import open_shared

        return {d["name"]: open_shared(d) for d in ref.cuda}

    def _is_own(self, ref: ShmRef) -> bool:
        return ref.segment == self._name

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._pool.free(check_key(key)) if self._pool else False

    def release(self, handle: dict[str, Any]) -> None:
        ref = ShmRef.from_handle(handle)
        with self._lock:
            if self._pool is not None and self._is_own(ref):
                entry = self._pool.entry_for(ref.slot, ref.gen)
                if entry is not None:
                    self._pool.free(entry.key)
                return
        self._reader.mark_consumed(ref)

    def stats(self) -> StoreStats:
        with self._lock:
            pool = self._pool
            if pool is not None:
                pool.reclaim()
            return StoreStats(pool.bytes_used if pool else 0, pool.num_entries if pool else 0,
                              self.config.capacity_bytes, self._hits, self._misses,
                              pool.evictions if pool else 0, self._puts, self._copied)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for finalizer in self._finalizers:
                finalizer()
            self._pool = None


def _share_cuda(name: str, t: torch.Tensor) -> dict[str, Any]:
    from services.connectors.cuda_ipc import share

    return share(name, t)
