"""Generate input: a GenerateRequest (POST /inference/v1/generate) -> ctx.rendered, as render would give.

The three input paths of PROTOCOL.md end in the same RenderResponse, so the
encode, prefill and decode steps run unchanged after this one (and the render
step, seeing ctx.rendered set, skips):

1. features (a render answer posted unchanged): built here, no call.  Each
   item's kwargs_data is decoded once (off the event loop) and its tensors
   written once into the coordinator's mm store, so from here on it travels
   by handle like a rendered item; only encode reads it, only its
   mm_metadata goes to prefill; an item without mm_metadata gets the light
   keys taken from its kwargs_data.  EC handles the caller already holds
   (ec_transfer_params) are used as is, so those items are not encoded again.
2. content_parts: render's RenderContentParts fetches the media with the same
   media policy as chat, processes and hashes it (a given uuid names the item within the request's
   model and cache_salt, which is sent along).
3. token_ids only: the same call with no parts, so render checks the ids
   (range, stray image placeholders) exactly as for chat.

The request's own sampling params, cache_salt and model replace render's.
"""

from __future__ import annotations

import asyncio
import binascii
import time

from services.config import EpdConfig
from services.connectors.base import ConnectorError, TensorStore
from services.connectors.mm import mm_key, store_item
from services.connectors.wiring import as_epd_error
from services.protocol.b64 import b64decode_strict
from services.protocol.errors import InvalidRequest, NotFound
from services.protocol.features import FeatureItem
from services.protocol.generate import GenerateRequest
from services.protocol.items import Item, metadata_only
from services.protocol.serialization import decode_item, encode_item
from services.rpc.convert import dumps, sampling_to_pb
from services.rpc.v1 import epd_pb2 as pb

from ..context import RequestContext
from .base import Step

# The light fields PROTOCOL.md names (what the consumer of embeddings still needs).
LIGHT_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "timestamps", "image_sizes")


def _bytes(b64: str, where: str) -> bytes | bytearray:
    try:
        return b64decode_strict(b64)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: not valid base64", code="invalid_base64") from None


def _decoded(raw: bytes | bytearray, where: str) -> Item:
    try:
        return decode_item(raw)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc.message}", code=exc.code) from None


def _item(item: FeatureItem, model: str, mm_store: TensorStore | None) -> pb.MultiModalItem:
    where = f"features.{{}}.{item.modality}[{item.index}]"
    kwargs = _bytes(item.kwargs_b64, where.format("kwargs_data")) if item.kwargs_b64 is not None else b""
    decoded = _decoded(kwargs, where.format("kwargs_data")) if kwargs and (
        mm_store is not None or item.metadata_b64 is None) else None
    if item.metadata_b64 is not None:
        metadata = _bytes(item.metadata_b64, where.format("mm_metadata"))
    elif decoded is not None:
        metadata = encode_item(metadata_only(decoded, LIGHT_KEYS))
    else:
        raise InvalidRequest(f"{where.format('mm_metadata')}: an item needs kwargs_data or mm_metadata",
                             code="missing_mm_metadata")
    place = item.placeholder
    out = pb.MultiModalItem(modality=item.modality, mm_hash=item.mm_hash, offset=place.offset,
                            length=place.length, mm_metadata=bytes(metadata))
    if decoded is not None and mm_store is not None:  # stored once; from here on it travels by handle
        skeleton, ref = store_item(mm_store, mm_key(model, item.mm_hash), decoded)
        out.kwargs_data, out.kwargs_ref_json = encode_item(skeleton), ref.to_json()
    else:  # (never copied into the message when it is stored: MBs in one call that holds the GIL)
        out.kwargs_data = bytes(kwargs)
    return out


def rendered_from_features(req: GenerateRequest, model: str,
                           mm_store: TensorStore | None = None) -> pb.RenderResponse:
    """The request as render would answer it; with `mm_store`, each item's tensors written into it once."""
    try:
        items = [_item(item, model, mm_store) for item in req.items()]
    except ConnectorError as exc:
        raise as_epd_error(exc, "mm") from None
    return pb.RenderResponse(request_id=req.request_id, token_ids=req.token_ids, items=items, model=model)


def check_model(req: GenerateRequest, config: EpdConfig) -> None:
    served = config.checkpoint.served_model_id()
    if req.model is not None and req.model != served:
        raise NotFound(f"The model `{req.model}` does not exist (served: {served})",
                             code="model_not_found")


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    wanted = num_prompt_tokens + (max_tokens or 1)
    if wanted > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 1} for the completion).",
            code="context_length_exceeded")


class GenerateInputStep(Step):
    name = "generate_input"

    async def execute(self, ctx: RequestContext) -> None:
        req = ctx.generate
        if ctx.kind != "generate" or req is None or ctx.rendered is not None:
            return
        started = time.perf_counter()
        check_model(req, self.cluster.config)
        if req.features is not None:  # MBs of base64 and msgpack: decoded and stored off the event loop
            served = self.cluster.config.checkpoint.served_model_id()
            ctx.rendered = await asyncio.to_thread(rendered_from_features, req, served, self.cluster.mm_store)
            self._known_handles(ctx, req)
        else:
            ctx.rendered = await self._render_parts(ctx, req)
        max_model_len = self.cluster.saw_context(ctx.rendered.max_model_len)
        check_fits(len(ctx.rendered.token_ids), req.sampling_params.max_tokens, max_model_len)
        if req.cache_salt is not None:
            ctx.rendered.cache_salt = req.cache_salt
        ctx.sampling = sampling_to_pb(req.sampling_params.model_dump(exclude={"extra_args"}))
        ctx.timings[self.name] = time.perf_counter() - started

    async def _render_parts(self, ctx: RequestContext, req: GenerateRequest) -> pb.RenderResponse:
        parts = [part.model_dump(exclude_none=True) for part in req.content_parts or []]
        request = pb.RenderContentPartsRequest(request_id=ctx.request_id, token_ids=req.token_ids,
                                               content_parts_json=dumps(parts))
        if req.cache_salt is not None:  # a part's uuid is scoped by it (services/render/uuid_scope.py)
            request.cache_salt = req.cache_salt
        reply, instance = await self.cluster.render.content_parts(ctx, request)
        ctx.instances["render"] = instance.address
        self.cluster.metrics.mm_payload_bytes.labels("render").inc(sum(len(i.kwargs_data) for i in reply.items))
        return reply

    @staticmethod
    def _known_handles(ctx: RequestContext, req: GenerateRequest) -> None:
        given = req.ec_transfer_params or {}
        for item in req.items():
            handle = given.get(item.mm_hash)
            if isinstance(handle, dict):
                ctx.ec_handles[item.mm_hash] = dumps(handle)
