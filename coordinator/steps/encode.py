"""Encode: one call per image not already in the EC store, all in parallel.

The coordinator remembers the handles encoders returned (a bounded LRU keyed
by mm_hash) so an image it has seen is not sent again; if prefill later finds
the entry gone (evicted), the pipeline's recovery policy forgets the
handles (`forget_handles`) and runs this step again.
Only this step ever sends kwargs_data (pixels), with one exception: an item
no encoder can take (all down or all full) is marked for inline encoding
(ctx.inline_items) when --prefill-inline-encode is on, and the prefill step
sends its kwargs_data to prefill instead (services/prefill/inline_encode.py).
Each encode call fails over between encoders on its own (clients.call_unary).
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.protocol.errors import InternalError, Overloaded, Unavailable
from services.rpc.fastlane_client import Relay
from services.rpc.v1 import epd_pb2 as pb

from ..ahead import Ahead, open_ahead, reserve
from ..clients import call_unary
from ..context import RequestContext
from .base import Step

log = logging.getLogger(__name__)


class EncodeStep(Step):
    name = "encode"

    def open_ahead(self, ctx: RequestContext) -> None:
        """While render computes: the call that gets render's answer as its inputs, as it is: render sends it on
        itself (a FORWARD) where it can, else the coordinator relays it as it reads it (coordinator/ahead.py).  The
        call encodes each image of the prompt once; one the coordinator knew already costs encode a cache lookup.
        Only with one encode instance to take it (which one an image goes to is chosen by its hash, not known
        before render answers) and a request that names an image at all."""
        relay = ctx.relays.get("render")
        if ctx.rendered is not None or relay is None or relay.target is not None or self.name in ctx.ahead or \
                b"image" not in ctx.body or len(self.cluster.encode.healthy()) != 1:
            return
        opened = open_ahead(self.cluster.encode, ctx, "Encode", lambda: pb.EncodeRequest(request_id=ctx.request_id),
                            ctx.time_left)
        if opened is not None:
            ctx.ahead[self.name] = opened
            relay.aim(opened.call)
            # encode's answer goes straight to prefill's call opened ahead: encode is told now, before it computes
            reserved = reserve(self.cluster.prefill, opened.call)
            if reserved is not None:
                ctx.reserved["prefill"] = reserved

    async def execute(self, ctx: RequestContext) -> None:
        ahead = ctx.ahead.pop(self.name, None)
        try:
            missing = self._missing_items(ctx)
            # render's answer went on to the call opened ahead as it was: that call answers for every image
            whole = self._unique(ctx) if ahead is not None and ahead.call.sent and not ctx.inline_items else []
            if not missing and not whole:
                return
            started = time.perf_counter()
            if ahead is not None and not ctx.inline_items:
                replies = await self._by_ahead(ctx, ahead, missing, whole)
                if replies is not None:
                    self._keep(ctx, replies)
                    ctx.timings["encode"] = time.perf_counter() - started
                    return
        finally:
            if ahead is not None and not ahead.used:
                ahead.cancel()
        await self._each(ctx, missing, started)

    async def _by_ahead(self, ctx: RequestContext, ahead: Ahead, missing: list[pb.MultiModalItem],
                        whole: list[pb.MultiModalItem]) -> list[pb.EncodedItem] | None:
        """The call opened ahead's answer: for every image of the prompt (`whole`) when render's answer went to it
        as it was, else for the missing ones (sent now); failing over to whole calls of the same items.  None
        when no encoder could take them (each item then goes its own way).  Counted per missing item (the known
        ones were counted as known)."""
        asked = whole or missing
        if not ahead.call.forwarded:   # forwarded: render sent its answer to encode, not through here
            self.cluster.metrics.mm_payload_bytes.labels("encode").inc(sum(len(i.kwargs_data) for i in asked))
        # its answer holds the asked images' handles: it may go on to prefill's call opened ahead as it arrives
        relay = ctx.relays[self.name] = Relay(frozenset(i.mm_hash for i in asked))
        ahead.call.relay_answer(relay)
        try:
            reply, instance = await call_unary(
                self.cluster.encode, ctx, "Encode", lambda: pb.EncodeRequest(request_id=ctx.request_id, items=asked),
                key=asked[0].mm_hash, ahead=ahead, inputs=lambda: pb.RenderResponse(items=asked))
        except (Unavailable, Overloaded):
            return None
        finally:
            del ctx.relays[self.name]
        found = {i.mm_hash: i for i in reply.items}
        if any(item.mm_hash not in found for item in asked):
            raise InternalError("encode answered without every image it was given", code="encode_incomplete")
        ctx.instances.setdefault("encode", instance.address)
        self.cluster.metrics.encode_calls.inc()
        for item in missing:
            self.cluster.metrics.mm_items.labels("cache_hit" if found[item.mm_hash].cache_hit else "encoded").inc()
        return [found[item.mm_hash] for item in asked]

    def _keep(self, ctx: RequestContext, replies: list[pb.EncodedItem | None]) -> None:
        for encoded in replies:
            if encoded is None:  # left to prefill (inline encode)
                continue
            ctx.ec_handles[encoded.mm_hash] = encoded.handle_json
            self.cluster.ec_handles.put(encoded.mm_hash, encoded.handle_json)

    async def _each(self, ctx: RequestContext, missing: list[pb.MultiModalItem], started: float) -> None:
        """One call per item, in parallel, each failing over on its own."""
        if len(missing) == 1:   # awaited here: a gather's task would cost two more turns of the loop
            # its answer may go on to prefill's call opened ahead as it arrives (PrefillStep.open_ahead)
            relay = ctx.relays[self.name] = Relay(frozenset({missing[0].mm_hash}))
            try:
                replies = [await self._encode_one(ctx, missing[0], relay)]
            finally:
                del ctx.relays[self.name]
        else:
            replies = await asyncio.gather(*(self._encode_one(ctx, item) for item in missing))
        self._keep(ctx, replies)
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

    @staticmethod
    def _unique(ctx: RequestContext) -> list[pb.MultiModalItem]:
        return list({i.mm_hash: i for i in ctx.image_items()}.values())

    def forget_handles(self, ctx: RequestContext) -> None:
        """The EC entries of this request are gone: forget their handles here and cluster-wide."""
        for item in ctx.image_items():
            self.cluster.ec_handles.pop(item.mm_hash)
            ctx.ec_handles.pop(item.mm_hash, None)

    async def _encode_one(self, ctx: RequestContext, item: pb.MultiModalItem,
                          relay: Relay | None = None) -> pb.EncodedItem | None:
        request = pb.EncodeRequest(request_id=ctx.request_id, items=[item])
        self.cluster.metrics.mm_payload_bytes.labels("encode").inc(len(item.kwargs_data))
        try:
            reply, instance = await call_unary(self.cluster.encode, ctx, "Encode", request, key=item.mm_hash,
                                               relay=relay)
        except (Unavailable, Overloaded) as exc:
            if not self._can_inline(item, exc):
                raise
            log.warning("no encode instance can take item %s (%s); prefill encodes it", item.mm_hash, exc.code)
            ctx.inline_items.add(item.mm_hash)
            self.cluster.metrics.mm_items.labels("inline").inc()
            return None
        ctx.instances.setdefault("encode", instance.address)
        self.cluster.metrics.encode_calls.inc()
        self.cluster.metrics.mm_items.labels("cache_hit" if reply.items[0].cache_hit else "encoded").inc()
        return reply.items[0]
