"""Render's gRPC servicer: parse, call RenderService, map to the proto.

Pixels by handle: with an mm store (the normal case), each item's tensors are
written once into it (in a worker thread, not on the event loop) and the
answer carries only the item's skeleton and the handle (services.connectors.mm);
the coordinator forwards both to encode.  Without one (tests, or a caller that
wants the bytes), the whole item travels inline as before.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import grpc
import numpy as np
from pydantic import BaseModel

from services.connectors.base import ConnectorError, TensorStore
from services.connectors.mm import mm_key, store_item
from services.connectors.wiring import as_epd_error, run_op
from services.observability.owned_metrics import OwnedGauges
from services.protocol.errors import InvalidRequest
from services.protocol.large_json import parse_json_large
from services.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.protocol.parsing import parse_json, validate_model
from services.protocol.serialization import encode_item
from services.rpc.convert import dumps
from services.rpc.handlers import rpc_method
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from .prompt import RenderedPrompt
from .serving import RenderService

M = TypeVar("M", bound=BaseModel)
OFF_LOOP_BYTES = 256 * 1024
GAUGES = {
    "epd_mm_store_bytes": ("Bytes of processed images held by this render's mm store",
                           lambda s: s.mm_store.stats().bytes_used),
    "epd_mm_store_entries": ("Processed images held by this render's mm store", lambda s: s.mm_store.stats().entries),
    "epd_mm_store_bytes_copied_total": ("Payload bytes the mm store copied (each image's tensors, once)",
                                        lambda s: s.mm_store.stats().bytes_copied),
}


def sampling_json(prompt: RenderedPrompt, max_model_len: int) -> bytes:
    """The effective sampling params; max_tokens absent -> the remaining context (not 16)."""
    params = prompt.sampling_params.model_dump(exclude={"extra_args"})
    if params.get("max_tokens") is None:
        params["max_tokens"] = max_model_len - len(prompt.token_ids)
    return dumps(params)


def to_response(prompt: RenderedPrompt, max_model_len: int,
                items: list[pb.MultiModalItem] | None = None) -> pb.RenderResponse:
    """The answer; `items` as built by `by_handle`, else each whole item inline."""
    if items is None:
        items = [pb.MultiModalItem(modality=i.modality, mm_hash=i.mm_hash, offset=i.offset, length=i.length,
                                   kwargs_data=encode_item(i.kwargs_item), mm_metadata=encode_item(i.metadata_item))
                 for i in prompt.items]
    reply = pb.RenderResponse(request_id=prompt.request_id, token_ids=prompt.token_ids, items=items,
                              sampling_params_json=sampling_json(prompt, max_model_len), model=prompt.model,
                              max_model_len=max_model_len)
    if prompt.cache_salt is not None:
        reply.cache_salt = prompt.cache_salt
    return reply


def by_handle(prompt: RenderedPrompt, store: TensorStore) -> list[pb.MultiModalItem]:
    """Each item's tensors written once into the mm store; the items carry the skeleton and the handle."""
    out = []
    for i in prompt.items:
        skeleton, ref = store_item(store, mm_key(prompt.model, i.mm_hash), i.kwargs_item)
        out.append(pb.MultiModalItem(modality=i.modality, mm_hash=i.mm_hash, offset=i.offset, length=i.length,
                                     kwargs_data=encode_item(skeleton), mm_metadata=encode_item(i.metadata_item),
                                     kwargs_ref_json=ref.to_json()))
    return out


async def _parsed(cls: type[M], raw: bytes) -> M:
    """The request model; a large body (MBs of data URLs) parsed and validated in a worker thread, its long
    strings outside json.loads (services/protocol/large_json.py) so the loop keeps running meanwhile."""
    def parse() -> M:   # long strings lifted out at any size: a data URL's scan is cheaper than json's
        return validate_model(cls, parse_json_large(raw))

    return parse() if len(raw) <= OFF_LOOP_BYTES else await asyncio.to_thread(parse)


class RenderServicer(rpc.RenderServiceServicer):
    def __init__(self, service: RenderService, mm_store: TensorStore | None = None) -> None:
        self.service, self.mm_store = service, mm_store
        self.gauges = OwnedGauges(self, GAUGES) if mm_store is not None else None

    async def _answer(self, prompt: RenderedPrompt) -> pb.RenderResponse:
        items = None
        if prompt.items and self.mm_store is not None:
            size = sum(elem.data.nbytes for i in prompt.items for elem in i.kwargs_item.values()
                       if isinstance(elem.data, np.ndarray))
            try:
                items = await run_op(self.mm_store, size, by_handle, prompt, self.mm_store)
            except ConnectorError as exc:
                raise as_epd_error(exc, "mm") from None
        return to_response(prompt, self.service.max_model_len, items)

    @rpc_method
    async def RenderChat(self, request: pb.RenderChatRequest, context: grpc.aio.ServicerContext):
        chat = await _parsed(ChatCompletionRequest, request.chat_request_json)
        prompt = await self.service.render_chat(chat, request.request_id or None)
        return await self._answer(prompt)

    @rpc_method
    async def RenderCompletion(self, request: pb.RenderCompletionRequest, context: grpc.aio.ServicerContext):
        completion = await _parsed(CompletionRequest, request.completion_request_json)
        prompts = await self.service.render_completion(completion, request.request_id or None)
        if len(prompts) != 1:
            raise InvalidRequest("prompt: the coordinator takes one prompt per request", code="too_many_prompts")
        return await self._answer(prompts[0])

    @rpc_method
    async def RenderContentParts(self, request: pb.RenderContentPartsRequest, context: grpc.aio.ServicerContext):
        parts = parse_json(request.content_parts_json)
        salt = request.cache_salt if request.HasField("cache_salt") else None
        prompt = await self.service.render_content_parts(list(request.token_ids), parts,
                                                         request_id=request.request_id or None, cache_salt=salt)
        return await self._answer(prompt)

    @rpc_method
    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext):
        return pb.DetokenizeResponse(text=self.service.detokenize(list(request.token_ids)))
