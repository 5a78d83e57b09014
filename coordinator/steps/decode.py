"""Decode: kv_transfer_params + first token -> an open decode stream (ctx.decode_stream).

The last step of Pipeline.prepare: it opens the decode stream and reads its
first chunk, failing over between decode instances (decode_stream.py), so a
request that has not reached decode yet is never lost and a full decode is a
plain 429.  A missing KV entry (NotFound `kv_entry_missing`) goes up to the
pipeline's recovery policy, which prefills again and runs this step again.
A resumed answer (ctx.resumed) tells decode the tokens the client has: decode
judges them again without sending them and goes on from the last one.
The open call is closed when its stream ends and, whatever happens, when the
request ends (inflight.on_close): a client that leaves between prepare and
the first read still frees the slot.
"""

from __future__ import annotations

import time

from services.rpc.v1 import epd_pb2 as pb

from .. import inflight
from ..context import RequestContext
from .base import Step


def _needs_prompt_ids(sampling: pb.SamplingParams) -> bool:
    """Penalties count prompt tokens too (vLLM semantics); otherwise decode needs no prompt ids."""
    return any(sampling.HasField(name) for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"))


class DecodeStep(Step):
    name = "decode"

    @staticmethod
    def request(ctx: RequestContext) -> pb.DecodeRequest:
        assert ctx.rendered is not None and ctx.prefill is not None
        prompt = ctx.rendered.token_ids
        request = pb.DecodeRequest(request_id=ctx.request_id, sampling=ctx.sampling, prompt_tokens=len(prompt),
                                   kv_transfer_params_json=ctx.prefill.kv_transfer_params_json,
                                   first_token_id=ctx.prefill.first_token_id, resumed_token_ids=ctx.resumed)
        if _needs_prompt_ids(request.sampling):
            request.prompt_token_ids.extend(prompt)
        return request

    async def execute(self, ctx: RequestContext) -> None:
        if ctx.decode_stream is not None:
            return
        started = time.perf_counter()
        opened = await self.cluster.decode.open(ctx, self.request(ctx))
        ctx.decode_stream = opened
        ctx.instances["decode"] = opened.instance.address
        ctx.timings["decode_first_chunk"] = time.perf_counter() - started
        inflight.on_close(opened.close)
