"""Prefill: token ids + mm_metadata + EC handles -> first token + KV handle.

Prefill gets no pixels, except the kwargs_data of items no encoder could take
(the encode step marks them; prefill then encodes them itself).

If prefill reports an embedding missing from the EC store (evicted, expired,
or its encoder died), the handles are forgotten, the items are encoded again
and prefill is retried once.
"""

from __future__ import annotations

import time

from services.protocol.errors import NotFound
from services.rpc.convert import dumps, loads, metadata_only
from services.rpc.v1 import epd_pb2 as pb

from ..clients import call_unary
from ..cluster import Cluster
from ..context import RequestContext
from .base import Step
from .encode import INLINE_ITEMS, EncodeStep

EC_MISSING_CODE = "ec_entry_missing"


class PrefillStep(Step):
    name = "prefill"

    def __init__(self, cluster: Cluster, encode: EncodeStep) -> None:
        self.cluster = cluster
        self.encode = encode

    async def execute(self, ctx: RequestContext) -> None:
        started = time.perf_counter()
        try:
            await self._prefill(ctx)
        except NotFound as exc:
            if exc.code != EC_MISSING_CODE:
                raise
            self.cluster.metrics.retries.labels("prefill", EC_MISSING_CODE).inc()
            self._forget_handles(ctx)
            await self.encode.execute(ctx)
            await self._prefill(ctx)
        ctx.timings["prefill"] = time.perf_counter() - started

    async def _prefill(self, ctx: RequestContext) -> None:
        assert ctx.rendered is not None
        inline = ctx.extra.get(INLINE_ITEMS, set())
        handles = {h: loads(ctx.ec_handles[h]) for h in {i.mm_hash for i in ctx.image_items()} - inline}
        request = pb.PrefillRequest(
            request_id=ctx.request_id, token_ids=ctx.rendered.token_ids,
            items=[i if i.mm_hash in inline else metadata_only(i) for i in ctx.image_items()],
            ec_transfer_params_json=dumps(handles) if handles else b"",
            sampling=ctx.extra["sampling"],
        )
        if ctx.rendered.HasField("cache_salt"):
            request.cache_salt = ctx.rendered.cache_salt
        ctx.prefill, instance = await call_unary(self.cluster.prefill, ctx, "Prefill", request)
        ctx.instances["prefill"] = instance.address

    def _forget_handles(self, ctx: RequestContext) -> None:
        for item in ctx.image_items():
            self.cluster.ec_handles.pop(item.mm_hash)
            ctx.ec_handles.pop(item.mm_hash, None)
