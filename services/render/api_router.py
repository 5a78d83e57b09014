"""Render's HTTP routes (PROTOCOL.md), thin adapters over RenderService and Derenderer.

- POST /v1/chat/completions/render -> one GenerateRequest (post it unchanged to
  /inference/v1/generate: "zero client conversion");
- POST /v1/completions/render -> a list of GenerateRequest, one per prompt;
- POST /v1/chat/completions/derender, /v1/completions/derender -> OpenAI answers
  (streaming: services.protocol.derender_stream);
- POST /tokenize, POST /detokenize, GET /v1/models (vLLM bodies).

The rendered request_id is vLLM's: `chatcmpl-<id>` / `cmpl-<id>` with <id> the X-Request-Id header,
else the body's request_id, else a fresh one.
"""

from __future__ import annotations

import asyncio
import functools

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.edge.http_api import endpoint, header_request_id, model_response, parse_body, read_body
from services.protocol.common import fresh_id
from services.protocol.derender_stream import ChatDerenderStreamRequest, CompletionDerenderStreamRequest
from services.protocol.openai import CompletionRequest
from services.protocol.openai_responses import ModelCard, ModelList
from services.protocol.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeResponse,
    parse_tokenize_request,
)

from .answer_format import RenderChatRequest, formatted
from .derender import Derenderer
from .derender_vllm import as_vllm_chat, as_vllm_completion
from .serving import RenderService


class RenderApi:
    def __init__(self, service: RenderService) -> None:
        self.service = service
        self.derenderer = Derenderer(service.tokenizer, service.model_id)

    @endpoint
    async def render_chat(self, request: Request) -> Response:
        chat = await parse_body(request, RenderChatRequest)
        prompt = await self.service.render_chat(chat, _vllm_id("chatcmpl-", request, chat.request_id))
        # base64 of the pixel arrays: megabytes per image, off the event loop.
        generate = await asyncio.to_thread(functools.partial(prompt.to_generate_request,
                                                             **chat.answer_kwargs(bool(prompt.items))))
        if chat.plain_answer:
            return model_response(generate)
        vision = self.service.vision
        pads = () if vision is None else tuple(t for t in (vision.pad_id, vision.video_pad_id) if t is not None)
        return JSONResponse(await asyncio.to_thread(formatted, generate, chat, pads))

    @endpoint
    async def render_completion(self, request: Request) -> Response:
        completion = await parse_body(request, CompletionRequest)
        prompts = await self.service.render_completion(completion, _vllm_id("cmpl-", request,
                                                                            completion.request_id))
        return model_response([p.to_generate_request() for p in prompts])

    @endpoint
    async def derender_chat(self, request: Request) -> Response:
        body = await parse_body(request, ChatDerenderStreamRequest)
        self.service.check_model(body.model)
        if not body.stream:
            return model_response(self.derenderer.chat(body))
        answer = self.derenderer.chat_stream(body)
        return model_response(as_vllm_chat(answer) if body.vllm_shape else answer)

    @endpoint
    async def derender_completion(self, request: Request) -> Response:
        body = await parse_body(request, CompletionDerenderStreamRequest)
        self.service.check_model(body.model)
        if not body.stream:
            return model_response(self.derenderer.completion(body))
        answer = self.derenderer.completion_stream(body)
        return model_response(as_vllm_completion(answer) if body.vllm_shape else answer)

    @endpoint
    async def tokenize(self, request: Request) -> Response:
        body = parse_tokenize_request(await read_body(request))
        self.service.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            tokens = await self.service.tokenize(
                messages=messages, add_special_tokens=body.add_special_tokens,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs)
        else:
            tokens = await self.service.tokenize(prompt=body.prompt,
                                                 add_special_tokens=body.add_special_tokens)
        strs = self.service.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return model_response(TokenizeResponse(count=len(tokens), max_model_len=self.service.max_model_len,
                                               tokens=tokens, token_strs=strs))

    @endpoint
    async def detokenize(self, request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest)
        self.service.check_model(body.model)
        return model_response(DetokenizeResponse(prompt=self.service.detokenize(body.tokens)))

    @endpoint
    async def models(self, request: Request) -> Response:
        service = self.service
        cards = [ModelCard(id=name, max_model_len=service.max_model_len, root=str(service.model_path))
                 for name in service.served_model_names]
        return model_response(ModelList(data=cards))


def _vllm_id(prefix: str, request: Request, body_id: str | None) -> str:
    """vLLM's rendered request_id: prefix + the X-Request-Id header, else the body's request_id, else fresh."""
    return prefix + (header_request_id(request) or body_id or fresh_id())


def routes(service: RenderService) -> list[Route]:
    api = RenderApi(service)
    return [
        Route("/v1/chat/completions/render", api.render_chat, methods=["POST"]),
        Route("/v1/completions/render", api.render_completion, methods=["POST"]),
        Route("/v1/chat/completions/derender", api.derender_chat, methods=["POST"]),
        Route("/v1/completions/derender", api.derender_completion, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
    ]
