"""The shm backend: tensors in a POSIX shared-memory pool on this host; device tensors by IPC handle.

Producer: one pool segment per store, created once (at construction unless
`preallocate=False`), pre-faulted and reused (shm_pool).  Consumer: any process
on the host loads by handle through cached attachments (shm_reader).  A handle:

    {"backend": "shm", "key", "segment", "slot", "generation", "offset", "length",
     "checksum": crc32 | None, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}],
     "cuda": [IPC descriptions of device tensors, see ipc.py / cuda_ipc.py]}

Device tensors (CUDA, by default `CudaIpc`) never touch the pool's bytes: `put` keeps them in the entry and
hands out their IPC descriptions; `put_into` with a spec on a device allocates them there for `fill` (a GPU
prefill's KV goes GPU to GPU).  A consumer leases the entry's slot while it reads them (ipc_lease.py), so
entries opened by several consumers are freed when the last one is done, and a consumer that dies lets go.

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
from typing import TYPE_CHECKING, Any, cast

from services.connectors.base import (
    ConnectorError,
    EntryCorrupt,
    StoreConfig,
    StoreStats,
    TensorSpec,
    TensorStore,
    check_key,
    spec_device,
)
from services.connectors.codec import Data, copy_into, is_array, plan, plan_specs, tensor_at
from services.connectors.ipc import IpcOpener
from services.connectors.shm_pool import PoolEntry, ShmPool
from services.connectors.shm_reader import ShmReader, ShmRef
from services.connectors.shm_segment import segment_name

if TYPE_CHECKING:
    import torch


class ShmTensorStore(TensorStore):
    backend = "shm"
    local = True  # the pool segment and the index are this host's memory

    def __init__(self, config: StoreConfig, ipc: IpcOpener | None = None) -> None:
        self.config = config
        self._ipc_opener = ipc   # None: CUDA IPC, imported at first use (a store of host tensors never needs torch)
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

    @property
    def _ipc(self) -> IpcOpener:
        if self._ipc_opener is None:
            from services.connectors.cuda_ipc import CudaIpc

            self._ipc_opener = CudaIpc()
        return self._ipc_opener

    def _by_handle(self, t: Data) -> bool:
        """`t` travels by IPC handle: a device tensor (or what a given opener claims: the tests' FAKE one)."""
        if _on_host(t) and self._ipc_opener is None:
            return False   # host data: no torch.cuda import for it
        return not is_array(t) and self._ipc.owns(t)

    def put(self, key: str, tensors: dict[str, Data]) -> dict[str, Any]:
        check_key(key)
        gpu = {n: cast("torch.Tensor", t) for n, t in tensors.items() if self._by_handle(t)}
        host = {n: t for n, t in tensors.items() if n not in gpu and _on_host(t)}
        if len(host) + len(gpu) != len(tensors):
            raise ConnectorError(f"entry {key!r}: only CPU tensors and {self._ipc.kind} device tensors can be stored")
        cuda = [self._ipc.share(n, t) for n, t in gpu.items()]
        specs, length = plan(host)
        entry = self._reserve(key, specs, length, sum(d["nbytes"] for d in cuda), list(gpu.values()))
        return self._fill_and_publish(entry, cuda, lambda buf: self._copy_in(buf, entry, host))

    def put_into(self, key: str, specs: dict[str, TensorSpec],
                 fill: Callable[[dict[str, torch.Tensor]], None]) -> dict[str, Any]:
        """One copy: `fill` writes straight into views of the reserved pool extent (not yet readable); specs on a
        device get tensors there, handed over by IPC handle (a GPU producer's data never leaves the GPU)."""
        check_key(key)
        if any(spec_device(spec) != "cpu" for spec in specs.values()):
            tensors = {name: self._ipc.empty(spec[0], spec[1], spec_device(spec)) for name, spec in specs.items()}
            fill(tensors)
            return self.put(key, dict(tensors))
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
        if not ref.cuda or self._is_own(ref):
            with self._reader.view(ref) as views:
                yield {**views, **self._open_cuda(ref)}
            return
        leases = self._reader.leases
        leases.acquire(ref.segment, ref.slot)   # before the slot header is checked (ipc_lease.py)
        opened: dict[str, torch.Tensor] = {}
        try:
            with self._reader.view(ref) as views:
                opened = self._open_cuda(ref)
                yield {**views, **opened}
        finally:   # given back once this process's reads of the device tensors completed
            leases.release_when(ref.segment, ref.slot, self._ipc.reads_done(list(opened.values())))

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
        ipc = self._ipc
        kinds = {d.get("kind", "cuda") for d in ref.cuda}
        if kinds != {ipc.kind}:
            raise EntryCorrupt(f"entry {ref.key!r} holds {sorted(kinds)} device tensors; this store opens {ipc.kind}")
        return {d["name"]: ipc.open(d) for d in ref.cuda}

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


def _on_host(t: Data) -> bool:
    return is_array(t) or cast("torch.Tensor", t).device.type == "cpu"
