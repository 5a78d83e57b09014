"""Render's gRPC servicer: parse, call RenderService, map to the proto."""

from __future__ import annotations

import grpc

from services.protocol.errors import InvalidRequest
from services.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.protocol.parsing import parse_json, parse_model
from services.protocol.serialization import encode_item
from services.rpc.convert import dumps
from services.rpc.handlers import rpc_method
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from .prompt import RenderedPrompt
from .serving import RenderService


def sampling_json(prompt: RenderedPrompt, max_model_len: int) -> bytes:
    """The effective sampling params; max_tokens absent -> the remaining context (not 16)."""
    params = prompt.sampling_params.model_dump(exclude={"extra_args"})
    if params.get("max_tokens") is None:
        params["max_tokens"] = max_model_len - len(prompt.token_ids)
    return dumps(params)


def to_response(prompt: RenderedPrompt, max_model_len: int) -> pb.RenderResponse:
    items = [pb.MultiModalItem(modality=i.modality, mm_hash=i.mm_hash, offset=i.offset, length=i.length,
                               kwargs_data=encode_item(i.kwargs_item), mm_metadata=encode_item(i.metadata_item))
             for i in prompt.items]
    reply = pb.RenderResponse(request_id=prompt.request_id, token_ids=prompt.token_ids, items=items,
                              sampling_params_json=sampling_json(prompt, max_model_len), model=prompt.model)
    if prompt.cache_salt is not None:
        reply.cache_salt = prompt.cache_salt
    return reply


class RenderServicer(rpc.RenderServiceServicer):
    def __init__(self, service: RenderService) -> None:
        self.service = service

    @rpc_method
    async def RenderChat(self, request: pb.RenderChatRequest, context: grpc.aio.ServicerContext):
        chat = parse_model(ChatCompletionRequest, request.chat_request_json)
        prompt = await self.service.render_chat(chat, request.request_id or None)
        return to_response(prompt, self.service.max_model_len)

    @rpc_method
    async def RenderCompletion(self, request: pb.RenderCompletionRequest, context: grpc.aio.ServicerContext):
        completion = parse_model(CompletionRequest, request.completion_request_json)
        prompts = await self.service.render_completion(completion, request.request_id or None)
        if len(prompts) != 1:
            raise InvalidRequest("prompt: the coordinator takes one prompt per request", code="too_many_prompts")
        return to_response(prompts[0], self.service.max_model_len)

    @rpc_method
    async def RenderContentParts(self, request: pb.RenderContentPartsRequest, context: grpc.aio.ServicerContext):
        parts = parse_json(request.content_parts_json)
        salt = request.cache_salt if request.HasField("cache_salt") else None
        prompt = await self.service.render_content_parts(list(request.token_ids), parts,
                                                         request_id=request.request_id or None, cache_salt=salt)
        return to_response(prompt, self.service.max_model_len)

    @rpc_method
    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext):
        return pb.DetokenizeResponse(text=self.service.detokenize(list(request.token_ids)))
