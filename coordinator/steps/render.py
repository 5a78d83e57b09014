"""Render: OpenAI request -> token ids, items (kwargs_data + mm_metadata), sampling params."""

from __future__ import annotations

import time

from services.rpc.convert import loads, sampling_to_pb
from services.rpc.fastlane_client import Relay
from services.rpc.v1 import epd_pb2 as pb

from ..clients import call_unary
from ..context import RequestContext
from .base import Step


class RenderStep(Step):
    name = "render"

    async def execute(self, ctx: RequestContext) -> None:
        if ctx.rendered is not None:
            return
        started = time.perf_counter()
        # the answer may go on to encode's call opened ahead as it arrives (EncodeStep.open_ahead)
        relay = ctx.relays[self.name] = Relay()
        try:
            if ctx.kind == "chat":
                request = pb.RenderChatRequest(request_id=ctx.request_id, chat_request_json=ctx.body)
                reply, instance = await call_unary(self.cluster.render, ctx, "RenderChat", request, relay=relay)
            else:
                request = pb.RenderCompletionRequest(request_id=ctx.request_id, completion_request_json=ctx.body)
                reply, instance = await call_unary(self.cluster.render, ctx, "RenderCompletion", request,
                                                   relay=relay)
        finally:
            del ctx.relays[self.name]
        ctx.rendered = reply
        self.cluster.metrics.mm_payload_bytes.labels("render").inc(sum(len(i.kwargs_data) for i in reply.items))
        ctx.sampling = sampling_to_pb(loads(reply.sampling_params_json) or {})
        ctx.instances["render"] = instance.address
        ctx.timings["render"] = time.perf_counter() - started
