"""Decode: kv_transfer_params + first token -> a stream of token deltas.

`execute` (the last step of Pipeline.prepare) opens the decode stream and
reads its first chunk, failing over between decode instances and re-running
prefill if the KV entry is gone (decode_stream.py), so a request that has
not reached decode yet is never lost and a full decode is a plain 429.
`stream` yields the chunks.  The open call is closed when the stream ends
and, whatever happens, when the request ends (inflight.on_close): a client
that leaves between prepare and the first read still frees the slot.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from services.rpc.v1 import epd_pb2 as pb

from .. import inflight
from ..cluster import Cluster
from ..context import RequestContext
from ..decode_stream import DecodeStream, open_decode
from .base import Step
from .prefill import PrefillStep


def _needs_prompt_ids(sampling: pb.SamplingParams) -> bool:
    """Penalties count prompt tokens too (vLLM semantics); otherwise decode needs no prompt ids."""
    return any(sampling.HasField(name) for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"))


class DecodeStep(Step):
    name = "decode"

    def __init__(self, cluster: Cluster, prefill: PrefillStep) -> None:
        self.cluster = cluster
        self.prefill = prefill

    def _request(self, ctx: RequestContext) -> pb.DecodeRequest:
        assert ctx.prefill is not None and ctx.rendered is not None
        request = pb.DecodeRequest(
            request_id=ctx.request_id, kv_transfer_params_json=ctx.prefill.kv_transfer_params_json,
            sampling=ctx.extra["sampling"], prompt_tokens=ctx.prefill.prompt_tokens,
            first_token_id=ctx.prefill.first_token_id)
        if _needs_prompt_ids(request.sampling):
            request.prompt_token_ids.extend(ctx.rendered.token_ids)
        return request

    async def execute(self, ctx: RequestContext) -> None:
        if "decode_stream" in ctx.extra:
            return
        ctx.extra["decode_started"] = time.perf_counter()
        opened = await open_decode(self.cluster.decode, ctx, lambda: self._request(ctx), self.prefill.execute)
        ctx.extra["decode_stream"] = opened
        inflight.on_close(opened.close)

    async def stream(self, ctx: RequestContext) -> AsyncIterator[pb.DecodeChunk]:
        await self.execute(ctx)
        opened: DecodeStream = ctx.extra["decode_stream"]
        try:
            async for chunk in opened.chunks():
                yield chunk
        finally:
            opened.close()
            ctx.timings["decode"] = time.perf_counter() - ctx.extra["decode_started"]
