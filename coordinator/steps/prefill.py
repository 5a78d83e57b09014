"""Prefill: token ids + mm_metadata + EC handles -> first token + KV handle (ctx.prefill).

Prefill gets no pixels, except the kwargs_data of items no encoder could take
(the encode step lists them in ctx.inline_items; prefill then encodes them
itself).  An embedding missing from the EC store comes back as NotFound
`ec_entry_missing`; the pipeline's recovery policy handles it (forget the
handles, encode again, then this step again).  A step that already has its
answer (ctx.prefill) returns at once.  While encode computes, the call is
opened ahead of its inputs where it can be (`open_ahead`, coordinator/ahead.py):
this step then sends only the handles.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from services.rpc.convert import dumps, loads, metadata_only
from services.rpc.fastlane_client import Relay
from services.rpc.v1 import epd_pb2 as pb

from ..ahead import open_ahead
from ..clients import call_unary
from ..context import RequestContext
from .base import Step


class PrefillStep(Step):
    name = "prefill"

    def open_ahead(self, ctx: RequestContext) -> None:
        """While encode computes: the call with everything but the handles (coordinator/ahead.py)."""
        if ctx.rendered is None or ctx.prefill is not None or ctx.inline_items or self.name in ctx.ahead:
            return
        reserved = ctx.reserved.pop(self.name, None)
        relay = ctx.relays.get("encode")
        rest = self._hashes(ctx) - relay.about if relay is not None else None
        # encode forwards its answer to the reserved call as it is: only where that answer is all the inputs
        opened = open_ahead(self.cluster.prefill, ctx, "Prefill", lambda: self.request(ctx, handles=False),
                            ctx.time_left, reserved=reserved if rest == set() else None)
        if opened is None:
            return
        ctx.ahead[self.name] = opened
        if relay is not None and relay.target is None and rest is not None and rest <= ctx.ec_handles.keys():
            # encode's answer holds the handles missing here: it goes on to this call as it arrives, with the rest
            relay.aim(opened.call, self._inputs(ctx, sorted(rest)).SerializeToString() if rest else b"")

    async def execute(self, ctx: RequestContext) -> None:
        if ctx.prefill is not None:
            return
        started = time.perf_counter()
        ahead = ctx.ahead.pop(self.name, None)
        try:
            if ahead is not None and ctx.inline_items:
                ahead.cancel()  # an item is left to prefill: its pixels go in a whole call
                ahead = None
            # a whole call's answer may go on to decode's call opened ahead as it arrives (DecodeStep.open_ahead)
            relay = ctx.relays[self.name] = Relay()
            ctx.prefill, instance = await call_unary(self.cluster.prefill, ctx, "Prefill", lambda: self.whole(ctx),
                                                     ahead=ahead, inputs=lambda: self._inputs(ctx, self._hashes(ctx)),
                                                     relay=relay)
        finally:
            ctx.relays.pop(self.name, None)
            if ahead is not None and not ahead.used:
                ahead.cancel()
        ctx.instances["prefill"] = instance.address
        ctx.timings["prefill"] = time.perf_counter() - started

    def whole(self, ctx: RequestContext) -> pb.PrefillRequest:
        request = self.request(ctx)
        self.cluster.metrics.mm_payload_bytes.labels("prefill").inc(sum(len(i.kwargs_data) for i in request.items))
        return request

    @staticmethod
    def _inputs(ctx: RequestContext, hashes: Iterable[str]) -> pb.EncodeResponse:
        """What a call opened ahead gets: the handles, in encode's own answer message."""
        return pb.EncodeResponse(request_id=ctx.request_id, items=[
            pb.EncodedItem(mm_hash=h, handle_json=ctx.ec_handles[h]) for h in hashes])

    @staticmethod
    def _hashes(ctx: RequestContext) -> set[str]:
        """The items whose embeddings prefill reads from the EC store (the rest it encodes itself)."""
        return {i.mm_hash for i in ctx.image_items()} - ctx.inline_items

    @staticmethod
    def request(ctx: RequestContext, handles: bool = True) -> pb.PrefillRequest:
        """The whole request; without `handles` the one opened ahead (they follow as its inputs)."""
        assert ctx.rendered is not None
        inline = ctx.inline_items
        ec = {h: loads(ctx.ec_handles[h]) for h in PrefillStep._hashes(ctx)} if handles else {}
        request = pb.PrefillRequest(
            request_id=ctx.request_id, token_ids=ctx.rendered.token_ids,
            items=[i if i.mm_hash in inline else metadata_only(i) for i in ctx.image_items()],
            ec_transfer_params_json=dumps(ec) if ec else b"", sampling=ctx.sampling,
            # its first token as decode's first chunk: sent on before decode answers (DecodeStep, decode_stream.py)
            first_chunk=not ctx.sampling.HasField("logprobs"))
        if ctx.rendered.HasField("cache_salt"):
            request.cache_salt = ctx.rendered.cache_salt
        return request

    @staticmethod
    def forget_answer(ctx: RequestContext) -> None:
        """The KV entry the answer points to is gone: the next pass prefills again."""
        ctx.prefill = None
