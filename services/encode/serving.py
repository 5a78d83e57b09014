"""Encode's core: kwargs items -> EC entries (embedding + family extras) in the EC store -> handles.

An item whose mm_hash is already stored is not encoded again (counted as a
cache hit); concurrent requests for the same item share one encode, which runs
as this service's own task: a request that leaves (cancelled, its client gone)
stops waiting for it without cancelling it for the others, and the embedding is
stored for the next request either way.  An item
that comes by handle (render's mm store, services.connectors.mm) is read as
zero-copy views kept open through the forward, so the tower's own input copy
is the only copy of its pixels; an entry evicted meanwhile fails the item
(`mm_entry_missing`) instead of storing an embedding of torn bytes.  Items
wait for the engine as futures (no thread each), so items of every request in
flight batch together; the EC put runs while the engine already runs the next
batch (on the event loop when small, services.connectors.wiring.run_op;
else in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter

from services.connectors.base import ConnectorError, TensorStore
from services.connectors.ec import ec_key
from services.connectors.mm import MmRef, open_item
from services.connectors.wiring import as_epd_error, run_op
from services.observability import activity
from services.observability.owned_metrics import OwnedGauges
from services.protocol.errors import DeadlineExceeded, InvalidRequest
from services.protocol.items import Item
from services.protocol.tensors import to_torch
from services.runtime.admission import Admission

from .engine import EncodeEngine

if TYPE_CHECKING:
    from services.weights.role import RoleWeights

log = logging.getLogger(__name__)
ITEMS = Counter("epd_encode_items", "Items requested, by result (encoded | cache_hit)", ["result"])
MM_BYTES = Counter("epd_encode_mm_bytes_received", "Multimodal bytes (kwargs_data + mm_metadata) received")
GAUGES = {
    "epd_ec_store_bytes": ("Bytes held by this instance's EC store", lambda s: s.store.stats().bytes_used),
    "epd_ec_store_entries": ("Entries held by this instance's EC store", lambda s: s.store.stats().entries),
    "epd_encode_forwards": ("Vision-tower forwards run so far", lambda s: s.engine.num_forwards),
    "epd_encode_queued_items": ("Items (embeddings to compute) waiting for the vision tower: with "
                                "epd_role_busy_fraction, what an autoscaler scales encode on",
                                lambda s: s.engine.num_pending),
    "epd_ec_store_bytes_copied_total": ("Payload bytes the EC store copied (puts in, gets out; views none)",
                                        lambda s: s.store.stats().bytes_copied),
    "epd_mm_store_bytes_copied_total": ("Payload bytes copied reading processed images by handle (views: none)",
                                        lambda s: s.mm_store.stats().bytes_copied),
}


@dataclass
class EncodedResult:
    mm_hash: str
    handle: dict
    cache_hit: bool
    weight_version: str = ""   # the weights that made the embedding


class EncodeService:
    def __init__(self, engine: EncodeEngine, store: TensorStore, model_id: str, timeout_s: float,
                 max_queue: int = 256, mm_store: TensorStore | None = None) -> None:
        self.engine, self.store, self.model_id, self.timeout_s = engine, store, model_id, timeout_s
        self.mm_store = mm_store  # where items sent by handle are read
        self._inflight: dict[str, asyncio.Task[EncodedResult]] = {}   # key -> the one encode of that item running
        self.weights: RoleWeights | None = None   # set by the app: the served version and its switch
        self.admission = Admission("encode", max_queue)  # items waiting for or in the tower
        self.gauges = OwnedGauges(self, GAUGES)  # read at scrape time: evictions and expiry show at once

    def serving_version(self, requested: str = "") -> str:
        """The weight version an item naming `requested` ("" names any) is encoded with; Conflict when another."""
        return self.weights.check(requested) if self.weights is not None else ""

    async def encode(self, mm_hash: str, item: Item | None, ref: MmRef | None = None,
                     weight_version: str = "") -> EncodedResult:
        """The item's EC handle; `item` is the skeleton when `ref` says where its tensors are.  The embedding is
        of the weights of `weight_version` (the served one, which the caller must name or leave ""), under a key
        of that version: another version's entry of the same item is another entry."""
        version = self.serving_version(weight_version)
        engine = self.engine   # taken with the version check, in the same turn of the loop as a switch would be
        key = ec_key(self.model_id, mm_hash, version)
        handle = self._lookup(key)
        if handle is not None:
            ITEMS.labels("cache_hit").inc()
            return EncodedResult(mm_hash, handle, True, version)
        if item is None:
            raise InvalidRequest(f"item {mm_hash}: no kwargs_data and not in the encoder cache",
                                 code="missing_kwargs_data")
        task = self._inflight.get(key)
        if task is not None:  # another request is encoding this item right now: not encoded twice
            ITEMS.labels("cache_hit").inc()
        else:
            admitted = self.admission.admit()
            admitted.__enter__()   # refused (Overloaded) at once when full; held until the encode ends
            task = asyncio.get_running_loop().create_task(self._encode(engine, key, mm_hash, item, ref, version))
            self._inflight[key] = task
            task.add_done_callback(lambda done: self._ended(key, done, admitted))
        return await asyncio.shield(task)   # leaving stops this request's wait, never the encode

    def _ended(self, key: str, task: asyncio.Task, admitted: contextlib.AbstractContextManager) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        admitted.__exit__(None, None, None)
        if not task.cancelled():
            task.exception()   # retrieved: every waiter re-raises it itself (none may be left)

    def _lookup(self, key: str) -> dict | None:
        try:
            return self.store.lookup(key)
        except ConnectorError as exc:
            raise as_epd_error(exc, "ec") from None

    async def _encode(self, engine: EncodeEngine, key: str, mm_hash: str, item: Item, ref: MmRef | None,
                      version: str) -> EncodedResult:
        try:
            with self._opened(item, ref) as full:
                entry = await self._forward(engine, mm_hash, full)
        except ConnectorError as exc:  # the mm entry is gone or was overwritten: the coordinator renders again
            raise as_epd_error(exc, "mm") from None
        try:
            activity.mark("encode.ec_put.start")
            handle = await run_op(self.store, sum(t.nbytes for t in entry.values()), self.store.put, key, entry)
            activity.mark("encode.ec_put.end")
        except ConnectorError as exc:
            raise as_epd_error(exc, "ec") from None
        ITEMS.labels("encoded").inc()
        return EncodedResult(mm_hash, handle, False, version)

    @contextlib.contextmanager
    def _opened(self, item: Item, ref: MmRef | None) -> Iterator[Item]:
        if ref is None:
            yield item
            return
        if self.mm_store is None:
            raise InvalidRequest("this encoder reads no mm store: send kwargs_data inline", code="no_mm_store")
        with open_item(self.mm_store, item, ref) as full:
            yield full

    async def _forward(self, engine: EncodeEngine, mm_hash: str, item: Item) -> dict:
        tensors = {name: to_torch(elem.data) for name, elem in item.items() if elem.data is not None}
        # One entry per item: the embedding plus whatever else the family's prefill needs (deepstack).
        # An idle engine runs a small forward right here (no hand-off to its thread and back); otherwise the
        # item is awaited as a future, not in a thread: every waiting item can join the engine's next batch.
        inline = engine.run_inline([tensors])
        if inline is not None:
            activity.mark("encode.engine_done")
            return inline[0]
        [future] = engine.submit([tensors])
        try:
            async with asyncio.timeout(self.timeout_s):   # not wait_for: it can drop a cancel (Python 3.11)
                entry = await asyncio.wrap_future(future)
                activity.mark("encode.engine_done")
                return entry
        except TimeoutError:
            raise DeadlineExceeded(f"encoding item {mm_hash} did not finish in {self.timeout_s} s") from None
