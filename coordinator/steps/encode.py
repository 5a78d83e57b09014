"""Encode: one call per image not already in the EC store, all in parallel.

The coordinator remembers the handles encoders returned (a bounded LRU keyed
by mm_hash) so an image it has seen is not sent again; if prefill later finds
the entry gone (evicted), the pipeline's recovery policy forgets the
handles (`forget_handles`) and runs this step again.
Only this step ever sends kwargs_data (pixels), with one exception: an item
no encoder can take (all down or all full) is marked for inline encoding
(ctx.inline_items) when --prefill-inline-encode is on, and the prefill step
sends its kwargs_data to prefill instead (services/prefill/inline_encode.py).
Each encode call fails over between encoders on its own (clients.EncodeClient).
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.protocol.errors import Overloaded, Unavailable
from services.rpc.v1 import epd_pb2 as pb

from ..context import RequestContext
from .base import Step

log = logging.getLogger(__name__)


class EncodeStep(Step):
    name = "encode"

    async def execute(self, ctx: RequestContext) -> None:
        missing = self._missing_items(ctx)
        if not missing:
            return
        started = time.perf_counter()
        if len(missing) == 1:   # awaited here: a gather's task would cost two more turns of the loop
            replies = [await self._encode_one(ctx, missing[0])]
        else:
            replies = await asyncio.gather(*(self._encode_one(ctx, item) for item in missing))
        for encoded in replies:
            if encoded is not None:   # None: left to prefill (inline encode)
                ctx.ec_handles[encoded.mm_hash] = encoded.handle_json
                self.cluster.ec_handles.put(encoded.mm_hash, encoded.handle_json)
        ctx.timings["encode"] = time.perf_counter() - started

    def _can_inline(self, item: pb.MultiModalItem, exc: Unavailable | Overloaded) -> bool:
        no_encoder = isinstance(exc, Overloaded) or exc.code == "encode_unavailable"
        return no_encoder and self.cluster.config.prefill_inline_encode and bool(item.kwargs_data)

    def _missing_items(self, ctx: RequestContext) -> list[pb.MultiModalItem]:
        unique: dict[str, pb.MultiModalItem] = {}
        for item in ctx.image_items():
            if item.mm_hash in ctx.ec_handles or item.mm_hash in ctx.inline_items or item.mm_hash in unique:
                continue
            known = self.cluster.ec_handles.get(item.mm_hash)
            if known is not None:
                ctx.ec_handles[item.mm_hash] = known
                self.cluster.metrics.ec_known_hits.inc()
                self.cluster.metrics.mm_items.labels("known").inc()
                continue
            unique[item.mm_hash] = item
        return list(unique.values())

    def forget_handles(self, ctx: RequestContext) -> None:
        """The EC entries of this request are gone: forget their handles here and cluster-wide."""
        for item in ctx.image_items():
            self.cluster.ec_handles.pop(item.mm_hash)
            ctx.ec_handles.pop(item.mm_hash, None)

    async def _encode_one(self, ctx: RequestContext, item: pb.MultiModalItem) -> pb.EncodedItem | None:
        self.cluster.metrics.mm_payload_bytes.labels("encode").inc(len(item.kwargs_data))
        try:
            encoded, instance = await self.cluster.encode.encode(ctx, item)
        except (Unavailable, Overloaded) as exc:
            if not self._can_inline(item, exc):
                raise
            log.warning("no encode instance can take item %s (%s); prefill encodes it", item.mm_hash, exc.code)
            ctx.inline_items.add(item.mm_hash)
            self.cluster.metrics.mm_items.labels("inline").inc()
            return None
        ctx.instances.setdefault("encode", instance.address)
        self.cluster.metrics.encode_calls.inc()
        self.cluster.metrics.mm_items.labels("cache_hit" if encoded.cache_hit else "encoded").inc()
        return encoded
