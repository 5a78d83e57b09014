"""Decode: kv_transfer_params + first token -> an open decode stream (ctx.decode_stream).

The last step of Pipeline.prepare: it opens the decode stream and reads its
first chunk, failing over between decode instances (decode_stream.py), so a
request that has not reached decode yet is never lost and a full decode is a
plain 429.  A missing KV entry (NotFound `kv_entry_missing`) goes up to the
pipeline's recovery policy, which prefills again and runs this step again.
The open call is closed when its stream ends and, whatever happens, when the
request ends (inflight.on_close): a client that leaves between prepare and
the first read still frees the slot.
"""

from __future__ import annotations

import time

from services.rpc.fastlane_client import Relay
from services.rpc.v1 import epd_pb2 as pb

from .. import inflight
from ..ahead import open_ahead
from ..context import RequestContext
from ..decode_stream import open_decode
from .base import Step


def _needs_prompt_ids(sampling: pb.SamplingParams) -> bool:
    """Penalties count prompt tokens too (vLLM semantics); otherwise decode needs no prompt ids."""
    return any(sampling.HasField(name) for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"))


class DecodeStep(Step):
    name = "decode"

    @staticmethod
    def request(ctx: RequestContext, ahead: bool = False) -> pb.DecodeRequest:
        """The whole request; with `ahead` the one opened before prefill answered (its answer follows)."""
        assert ctx.rendered is not None and (ahead or ctx.prefill is not None)
        request = pb.DecodeRequest(request_id=ctx.request_id, sampling=ctx.sampling,
                                   prompt_tokens=len(ctx.rendered.token_ids))
        if ctx.prefill is not None and not ahead:
            request.kv_transfer_params_json = ctx.prefill.kv_transfer_params_json
            request.prompt_tokens = ctx.prefill.prompt_tokens
            request.first_token_id = ctx.prefill.first_token_id
        if _needs_prompt_ids(request.sampling):
            request.prompt_token_ids.extend(ctx.rendered.token_ids)
        request.ack_reserved = ahead   # decode says when it took the request: prefill's first chunk may go then
        return request

    def open_ahead(self, ctx: RequestContext) -> None:
        """While prefill (or encode) computes: the call that reserves the request's decode slot and blocks."""
        if ctx.rendered is None or ctx.prefill is not None or ctx.decode_stream is not None or self.name in ctx.ahead:
            return
        opened = open_ahead(self.cluster.decode, ctx, "Decode", lambda: self.request(ctx, ahead=True),
                            ctx.total_left)
        if opened is None:
            return
        ctx.ahead[self.name] = opened
        # prefill's answer is exactly this call's inputs: on as it arrives, from its call opened ahead or whole
        prefill, relay = ctx.ahead.get("prefill"), ctx.relays.get("prefill")
        if prefill is not None:
            prefill.call.relay_answer(Relay(target=opened.call))
        elif relay is not None and relay.target is None:
            relay.aim(opened.call)

    async def execute(self, ctx: RequestContext) -> None:
        if ctx.decode_stream is not None:
            return
        started = time.perf_counter()
        ahead = ctx.ahead.pop(self.name, None)
        try:
            opened = await open_decode(self.cluster.decode, ctx, lambda: self.request(ctx), ahead)
        finally:
            if ahead is not None and not ahead.used:
                ahead.cancel()
        ctx.decode_stream = opened
        ctx.instances["decode"] = opened.instance.address
        ctx.timings["decode_first_chunk"] = time.perf_counter() - started
        inflight.on_close(opened.close)
