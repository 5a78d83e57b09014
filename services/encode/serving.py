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

A video is stored by frame group (frame_groups.py): only the groups not stored yet are encoded
(each an item of its own, so they batch with everything else waiting), and the answer is a composite
handle listing every group's entry; `epd_encode_frame_groups_total{result}` counts groups found and
encoded.
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
from services.connectors.ec import composite_handle, ec_key
from services.connectors.mm import MmRef, open_item
from services.connectors.wiring import as_epd_error, run_op
from services.observability import activity
from services.observability.owned_metrics import OwnedGauges
from services.protocol.errors import DeadlineExceeded, InvalidRequest
from services.protocol.items import Item
from services.protocol.tensors import to_torch
from services.runtime.admission import Admission

from . import frame_groups
from .engine import EncodeEngine

if TYPE_CHECKING:
    from services.weights.role import RoleWeights

log = logging.getLogger(__name__)
ITEMS = Counter("epd_encode_items", "Items requested, by result (encoded | cache_hit)", ["result"])
MM_BYTES = Counter("epd_encode_mm_bytes_received", "Multimodal bytes (kwargs_data + mm_metadata) received")
GROUPS = Counter("epd_encode_frame_groups", "Video frame groups requested, by result (cache_hit: found in the EC "
                 "store, not encoded again | encoded)", ["result"])
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
        self._groups_inflight: dict[str, asyncio.Future[dict]] = {}   # group key -> its handle, while encoded
        self.videos = frame_groups.VideoIndex()
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
        if handle is None and self.videos.get(key) is not None:   # a video stored here: its groups, looked up
            handle = await run_op(self.store, 0, self._stored_video, engine, key)
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
            by_groups = frame_groups.is_video(item) and getattr(engine.vision, "frame_groups_independent", False)
            work = self._encode_video(engine, key, mm_hash, item, ref, version) if by_groups \
                else self._encode(engine, key, mm_hash, item, ref, version)
            task = asyncio.get_running_loop().create_task(work)
            self._inflight[key] = task
            task.add_done_callback(lambda done: self._ended(key, done, admitted))
        return await asyncio.shield(task)   # leaving stops this request's wait, never the encode

    def _ended(self, key: str, task: asyncio.Task, admitted: contextlib.AbstractContextManager) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        admitted.__exit__(None, None, None)
        if not task.cancelled():
            task.exception()   # retrieved: every waiter re-raises it itself (none may be left)

    def _stored_video(self, engine: EncodeEngine, key: str) -> dict | None:
        """A video this encoder stored (under its EC key: model, weight version and mm_hash), when every one of its
        groups is still in the store."""
        keys = self.videos.get(key)
        if keys is None:
            return None
        handles = [self._lookup(k) for k in keys]
        if any(h is None for h in handles):
            return None
        GROUPS.labels("cache_hit").inc(len(handles))
        return composite_handle(handles, engine.vision.token_dims)  # type: ignore[arg-type]

    async def _encode_video(self, engine: EncodeEngine, key: str, mm_hash: str, item: Item, ref: MmRef | None,
                            version: str) -> EncodedResult:
        """The video's groups: those stored are looked up, the others encoded (once, also when several requests
        ask at once) and stored; the answer is the composite of their handles, in order."""
        try:
            with self._opened(item, ref) as full:
                tensors = {name: to_torch(elem.data) for name, elem in full.items() if elem.data is not None}
                nbytes = int(tensors[frame_groups.PIXELS].nbytes)
                groups = await run_op(self.store, nbytes, frame_groups.split, self.model_id, tensors, version)
                handles = await self._group_handles(engine, groups)
        except ConnectorError as exc:
            raise as_epd_error(exc, "mm") from None
        self.videos.put(key, tuple(g.key for g in groups))
        encoded = any(h[1] for h in handles)
        ITEMS.labels("encoded" if encoded else "cache_hit").inc()
        return EncodedResult(mm_hash, composite_handle([h[0] for h in handles], engine.vision.token_dims),
                             not encoded, version)

    async def _group_handles(self, engine: EncodeEngine, groups: list[frame_groups.FrameGroup]
                             ) -> list[tuple[dict, bool]]:
        """(handle, encoded here) per group, in order; the new ones go to the engine together."""
        found: dict[str, tuple[dict, bool]] = {}
        waiting: dict[str, asyncio.Future[dict]] = {}
        mine: dict[str, frame_groups.FrameGroup] = {}
        keys = list(dict.fromkeys(group.key for group in groups))
        stored = await run_op(self.store, 0, lambda: {k: self._lookup(k) for k in keys})  # Redis: off the loop
        for group in groups:
            if group.key in found or group.key in waiting or group.key in mine:
                continue   # the same frames twice in one video: one entry
            handle = stored[group.key]
            if handle is not None:
                found[group.key] = (handle, False)
            elif group.key in self._groups_inflight:
                waiting[group.key] = self._groups_inflight[group.key]
            else:
                mine[group.key] = group
                self._groups_inflight[group.key] = asyncio.get_running_loop().create_future()
        GROUPS.labels("cache_hit").inc(len(found) + len(waiting))
        try:
            found.update(await self._store_groups(engine, list(mine.values())))
        finally:
            for key in mine:
                future = self._groups_inflight.pop(key)
                if key in found:
                    future.set_result(found[key][0])
                else:
                    future.set_exception(InvalidRequest("encoding a shared frame group failed", code="encode_failed"))
                    future.exception()
        for key, future in waiting.items():
            found[key] = (await asyncio.shield(future), False)
        return [found[group.key] for group in groups]

    async def _store_groups(self, engine: EncodeEngine, groups: list[frame_groups.FrameGroup]
                            ) -> dict[str, tuple[dict, bool]]:
        """Encode the groups in one engine submission and store each entry."""
        if not groups:
            return {}
        entries = await self._forward_many(engine, [g.tensors for g in groups])
        GROUPS.labels("encoded").inc(len(groups))
        out = {}
        for group, entry in zip(groups, entries, strict=True):
            try:
                handle = await run_op(self.store, sum(t.nbytes for t in entry.values()), self.store.put, group.key,
                                      entry)
            except ConnectorError as exc:
                raise as_epd_error(exc, "ec") from None
            out[group.key] = (handle, True)
        return out

    async def _forward_many(self, engine: EncodeEngine, items: list[dict]) -> list[dict]:
        inline = engine.run_inline(items)
        if inline is not None:
            return inline
        futures = engine.submit(items)
        try:
            async with asyncio.timeout(self.timeout_s):
                return [await asyncio.wrap_future(f) for f in futures]
        except TimeoutError:
            for future in futures:
                future.cancel()
            raise DeadlineExceeded(f"encoding {len(items)} frame group(s) did not finish in {self.timeout_s} s") \
                from None

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
