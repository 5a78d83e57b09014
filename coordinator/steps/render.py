"""Render: OpenAI request -> token ids, items (kwargs_data + mm_metadata), sampling params."""

from __future__ import annotations

import time

from services.rpc.convert import loads, sampling_to_pb

from ..context import RequestContext
from .base import Step


class RenderStep(Step):
    name = "render"

    async def execute(self, ctx: RequestContext) -> None:
        if ctx.rendered is not None:
            return
        started = time.perf_counter()
        render = self.cluster.render
        if ctx.kind == "chat":
            reply, instance = await render.chat(ctx, ctx.body)
        else:
            reply, instance = await render.completion(ctx, ctx.body)
        ctx.rendered = reply
        self.cluster.metrics.mm_payload_bytes.labels("render").inc(sum(len(i.kwargs_data) for i in reply.items))
        ctx.sampling = sampling_to_pb(loads(reply.sampling_params_json) or {})
        ctx.instances["render"] = instance.address
        ctx.timings["render"] = time.perf_counter() - started
