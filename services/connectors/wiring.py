"""Connector stores built from the process config, and connector errors as epd errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from services.config import EpdConfig
from services.models.device_plan import is_cuda
from services.protocol.errors import EpdError, NotFound, Unavailable

from .base import BackendUnavailable, ConnectorError, EntryCorrupt, EntryMissing, StoreConfig, TensorStore
from .registry import create_store

T = TypeVar("T")
INLINE_BYTES = 1024 * 1024
"""A local store's operation on at most this many payload bytes runs on the calling event loop: a copy of
1 MiB takes ~20 us here back to back and ~0.1 ms cold, a round trip through a worker thread ~300 us (two
wake-ups).  (A 224x224 image's uint8 patches are 301,056 bytes.)  Larger ones, and every operation of a store
that does I/O (Redis), run in a worker thread."""


async def run_op(store: TensorStore, nbytes: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, a store operation on `nbytes` payload bytes: inline when small and local, else in a thread."""
    if runs_inline(store, nbytes):
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def runs_inline(store: TensorStore, nbytes: int) -> bool:
    """Whether `run_op` would run an operation on `nbytes` payload bytes of `store` on the loop."""
    return store.local and nbytes <= INLINE_BYTES


def store_config(config: EpdConfig, purpose: str, producer: bool = True) -> StoreConfig:
    """The store of `purpose`: "ec", "kv", or "mm" (multimodal inputs: the EC connector's backend)."""
    stores = config.stores
    backend = stores.kv_connector if purpose == "kv" else stores.ec_connector
    capacity_mb = {"ec": stores.ec_capacity_mb, "kv": stores.kv_capacity_mb, "mm": stores.mm_capacity_mb}[purpose]
    ttl = {"ec": stores.ec_ttl_s, "kv": stores.kv_ttl_s, "mm": stores.mm_ttl_s}[purpose]
    return StoreConfig(backend=backend, purpose=purpose, instance_id=config.server.instance_id,
                       capacity_bytes=capacity_mb * 1024 * 1024, ttl_s=ttl,
                       redis_url=config.stores.redis_url if backend == "redis" else None,
                       preallocate=producer, pin_memory=purpose != "mm" and is_cuda(config.checkpoint.device))


def open_store(config: EpdConfig, purpose: str, producer: bool = True) -> TensorStore:
    """A producer owns a preallocated pool; a consumer only reads others' entries by handle."""
    return create_store(store_config(config, purpose, producer))


def as_epd_error(exc: ConnectorError, purpose: str) -> EpdError:
    """Missing or corrupt entries are 'not found' (the coordinator re-encodes); a down backend is a 503."""
    if isinstance(exc, BackendUnavailable):
        return Unavailable(f"{purpose} store unavailable: {exc}", code=f"{purpose}_store_unavailable")
    if isinstance(exc, (EntryMissing, EntryCorrupt)):
        return NotFound(f"{purpose} entry unusable: {exc}", code=f"{purpose}_entry_missing")
    return Unavailable(f"{purpose} store error: {exc}", code=f"{purpose}_store_error")
