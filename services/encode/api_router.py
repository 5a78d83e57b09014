"""Encode's HTTP routes (PROTOCOL.md): POST /inference/v1/generate, /v1/chat/completions, /abort_requests.

POST /v1/chat/completions takes llm-d's OpenAI-format encode call (services.edge.openai_calls).

Generate on encode means: take each item's kwargs_data (a null entry means
"already encoded: resolve by mm_hash"), run the vision tower through the same
EncodeService the gRPC servicer uses, and answer `ec_transfer_params`
{mm_hash: handle} that prefill loads the embeddings with.  No tokens are
generated: the one choice is empty with finish_reason "stop".
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.edge.http_api import (
    check_model,
    check_tokens_mode,
    endpoint,
    header_request_id,
    model_response,
    parse_body,
)
from services.edge.openai_calls import RenderClient, openai_call
from services.protocol.common import Usage
from services.protocol.errors import InvalidRequest
from services.protocol.features import FeatureItem
from services.protocol.generate import AbortRequest, GenerateChoice, GenerateRequest, GenerateResponse, response_id
from services.protocol.items import Item
from services.protocol.serialization import item_from_b64

from .serving import MM_BYTES, EncodeService


def _unique_items(request: GenerateRequest) -> dict[str, FeatureItem]:
    if request.content_parts:
        raise InvalidRequest("encode takes rendered features (kwargs_data), not content_parts: send "
                             "content_parts to render or the coordinator", code="content_parts_not_supported")
    items: dict[str, FeatureItem] = {}
    for item in request.items():
        items.setdefault(item.mm_hash, item)
    if not items:
        raise InvalidRequest("encode needs features with at least one multimodal item",
                             code="no_multimodal_items")
    return items


def _kwargs(item: FeatureItem) -> Item | None:
    if item.kwargs_b64 is None:
        return None  # resolve by hash from the encoder cache
    MM_BYTES.inc(len(item.kwargs_b64) * 3 // 4)
    try:
        return item_from_b64(item.kwargs_b64)
    except InvalidRequest as exc:
        raise InvalidRequest(f"features.kwargs_data.{item.modality}[{item.index}]: {exc.message}",
                             code=exc.code) from None


class EncodeApi:
    def __init__(self, service: EncodeService, render: RenderClient) -> None:
        self.service, self.render = service, render

    @endpoint
    async def generate(self, request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        check_tokens_mode(body.output_mode, "encode")
        return model_response(await self._encode(body, request))

    @endpoint
    async def chat(self, request: Request) -> Response:
        """llm-d's OpenAI-format encode call: one image in a chat body (services.edge.openai_calls)."""
        call = await openai_call(request, self.render)
        return model_response(call.answer(await self._encode(call.generate, request)))

    async def _encode(self, body: GenerateRequest, request: Request) -> GenerateResponse:
        check_model(body.model, self.service.model_id)
        items = _unique_items(body)
        decoded = {mm_hash: _kwargs(item) for mm_hash, item in items.items()}
        results = await asyncio.gather(*(self.service.encode(h, item) for h, item in decoded.items()))
        return GenerateResponse(
            request_id=response_id(body.request_id, header_request_id(request)),
            model=body.model or self.service.model_id,
            choices=[GenerateChoice(index=0, token_ids=[], finish_reason="stop")],
            usage=Usage(prompt_tokens=len(body.token_ids), completion_tokens=0),
            ec_transfer_params={r.mm_hash: r.handle for r in results})

    @endpoint
    async def abort(self, request: Request) -> Response:
        await parse_body(request, AbortRequest)
        return JSONResponse({"aborted": 0})  # an encode runs to completion in one call; nothing to stop


def routes(service: EncodeService, render: RenderClient | None = None) -> list[Route]:
    api = EncodeApi(service, render or RenderClient([]))
    return [Route("/inference/v1/generate", api.generate, methods=["POST"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/abort_requests", api.abort, methods=["POST"])]
