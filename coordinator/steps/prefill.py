"""Prefill: token ids + mm_metadata + EC handles -> first token + KV handle (ctx.prefill).

Prefill gets no pixels, except the kwargs_data of items no encoder could take
(the encode step lists them in ctx.inline_items; prefill then encodes them
itself).  An embedding missing from the EC store comes back as NotFound
`ec_entry_missing`; the pipeline's recovery policy handles it (forget the
handles, encode again, then this step again).  A step that already has its
answer (ctx.prefill) returns at once.  A resumed answer (ctx.resumed: the
decode instance serving it died) prefills the prompt and every token the
client has but the last, which decode then goes on from.
"""

from __future__ import annotations

import time

from services.rpc.convert import dumps, loads, metadata_only
from services.rpc.v1 import epd_pb2 as pb

from ..context import RequestContext
from .base import Step


class PrefillStep(Step):
    name = "prefill"

    async def execute(self, ctx: RequestContext) -> None:
        if ctx.prefill is not None:
            return
        started = time.perf_counter()
        request = self.request(ctx)
        self.cluster.metrics.mm_payload_bytes.labels("prefill").inc(sum(len(i.kwargs_data) for i in request.items))
        ctx.prefill, instance = await self.cluster.prefill.prefill(ctx, request)
        ctx.instances["prefill"] = instance.address
        ctx.timings["prefill"] = time.perf_counter() - started

    @staticmethod
    def request(ctx: RequestContext) -> pb.PrefillRequest:
        assert ctx.rendered is not None
        inline = ctx.inline_items
        items = ctx.image_items()
        ec = {i.mm_hash: loads(ctx.ec_handles[i.mm_hash]) for i in items if i.mm_hash not in inline}
        request = pb.PrefillRequest(
            request_id=ctx.request_id, token_ids=[*ctx.rendered.token_ids, *ctx.resumed[:-1]],
            items=[i if i.mm_hash in inline else metadata_only(i) for i in items],
            ec_transfer_params_json=dumps(ec) if ec else b"", sampling=ctx.sampling)
        if ctx.rendered.HasField("cache_salt"):
            request.cache_salt = ctx.rendered.cache_salt
        return request

    @staticmethod
    def forget_answer(ctx: RequestContext) -> None:
        """The KV entry the answer points to is gone: the next pass prefills again."""
        ctx.prefill = None
