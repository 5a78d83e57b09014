"""Encode: one call per image not already in the EC store, all in parallel.

The coordinator remembers the handles encoders returned (a bounded LRU keyed
by mm_hash) so an image it has seen is not sent again; if prefill later finds
the entry gone (evicted), the prefill step forgets it and encodes again.
Only this step ever sends kwargs_data (pixels).
"""

from __future__ import annotations

import asyncio
import time

from services.rpc.v1 import epd_pb2 as pb

from ..clients import call_unary
from ..cluster import Cluster
from ..context import RequestContext
from .base import Step


class EncodeStep(Step):
    name = "encode"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def execute(self, ctx: RequestContext) -> None:
        missing = self._missing_items(ctx)
        if not missing:
            return
        started = time.perf_counter()
        replies = await asyncio.gather(*(self._encode_one(ctx, item) for item in missing))
        for encoded in replies:
            ctx.ec_handles[encoded.mm_hash] = encoded.handle_json
            self.cluster.ec_handles.put(encoded.mm_hash, encoded.handle_json)
        ctx.timings["encode"] = time.perf_counter() - started

    def _missing_items(self, ctx: RequestContext) -> list[pb.MultiModalItem]:
        unique: dict[str, pb.MultiModalItem] = {}
        for item in ctx.image_items():
            if item.mm_hash in ctx.ec_handles or item.mm_hash in unique:
                continue
            known = self.cluster.ec_handles.get(item.mm_hash)
            if known is not None:
                ctx.ec_handles[item.mm_hash] = known
                self.cluster.metrics.ec_known_hits.inc()
                continue
            unique[item.mm_hash] = item
        return list(unique.values())

    async def _encode_one(self, ctx: RequestContext, item: pb.MultiModalItem) -> pb.EncodedItem:
        request = pb.EncodeRequest(request_id=ctx.request_id, items=[item])
        reply, instance = await call_unary(self.cluster.encode, ctx, "Encode", request, key=item.mm_hash)
        ctx.instances.setdefault("encode", instance.address)
        self.cluster.metrics.encode_calls.inc()
        return reply.items[0]
