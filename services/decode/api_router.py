"""Decode's HTTP routes (PROTOCOL.md): POST /inference/v1/generate, /v1/chat/completions, /v1/completions,
/abort_requests.

POST /v1/chat/completions and /v1/completions take llm-d's (and vLLM's E/P/D proxy's) OpenAI-format decode calls
(services.edge.openai_calls) and answer the client's chat completion or completion.

Generate on decode means: kv_transfer_params from a prefill answer (+ sampling)
-> every output token, the first one (sampled by prefill) included, as one
GenerateResponse or as SSE (`data: <chunk>` with the token_ids delta, a usage
event with include_usage, errors in-stream as `data: {"error": ...}`, then
`data: [DONE]`).  Same DecodeService as gRPC.  Errors before the first event
(bad or missing KV handle, decode full) are plain HTTP errors; a client that
goes away mid-stream aborts the request and frees its slot.

The engine runs the request under the caller's id (X-Request-Id, else
request_id); /abort_requests takes that id, with or without the
"generate-tokens-" prefix.  The answer is built by services.protocol.answers
(the same builder as the coordinator's generate route).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.edge.http_api import check_model, endpoint, header_request_id, model_response, parse_body, sse_response
from services.edge.openai_calls import RenderClient, openai_call
from services.protocol.answers import GenerateAnswer, OpenAIAnswer, OutputDelta
from services.protocol.errors import EpdError, InternalError, InvalidRequest
from services.protocol.generate import RESPONSE_ID_PREFIX, AbortRequest, GenerateRequest, response_id

from .serving import DecodeService
from .stream import DecodeEvent


def _event_error(event: DecodeEvent) -> EpdError:
    return InternalError(event.error or "decode failed", code="decode_error")


async def output_deltas(first: DecodeEvent, events: AsyncIterator[DecodeEvent],
                        weight_version: str | None = None) -> AsyncIterator[OutputDelta]:
    """The engine's events, the first included, as answer deltas (every sample's, until the stream ends); an
    error event raises (in-stream error)."""
    try:
        event = first
        while True:
            if event.finish_reason == "error":
                raise _event_error(event)
            yield OutputDelta(token_ids=event.token_ids, text=event.text, finish_reason=event.finish_reason,
                              stop_reason=event.stop_reason, logprobs=event.logprobs, index=event.index,
                              weight_version=weight_version)
            event = await anext(events)
    except StopAsyncIteration:
        return
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()  # now, not at garbage collection: an early exit frees the slot at once


def decode_answer(body: GenerateRequest, rsp_id: str, model: str) -> GenerateAnswer:
    kv = body.kv_transfer_params or {}
    return GenerateAnswer(rsp_id, model, int(kv.get("num_prompt_tokens") or len(body.token_ids)),
                          body.stream_options, output_mode=body.output_mode, samples=body.sampling_params.n)


class DecodeApi:
    def __init__(self, service: DecodeService, model_id: str, render: RenderClient) -> None:
        self.service, self.model_id, self.render = service, model_id, render

    @endpoint
    async def generate(self, request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        header = header_request_id(request)
        deltas = await self._decode(body, header or body.request_id)
        built = decode_answer(body, response_id(body.request_id, header), body.model or self.model_id)
        if body.stream:
            return sse_response(built.sse(deltas))
        return model_response(await built.collect(deltas))

    async def _decode(self, body: GenerateRequest, request_id: str,
                      kind: Literal["chat", "completion"] | None = None) -> AsyncIterator[OutputDelta]:
        """Start decoding `body` (an OpenAI-format `kind` of call: its prompt must be the prefill's); the first
        event is awaited before any byte is sent, so setup errors become plain HTTP errors."""
        check_model(body.model, self.model_id)
        kv = body.kv_transfer_params
        if kv is None:
            raise InvalidRequest("decode needs kv_transfer_params (from a prefill answer)",
                                 code="missing_kv_transfer_params")
        if kind is not None and kv.get("num_prompt_tokens") != len(body.token_ids):
            raise InvalidRequest(f"kv_transfer_params hold the KV of {kv.get('num_prompt_tokens')} prompt tokens "
                                 f"but this {kind} renders to {len(body.token_ids)}: send the {kind} the prefill "
                                 "had", code="kv_prompt_mismatch")
        sampling = body.sampling_params.model_dump(exclude={"extra_args"})
        version = self.service.serving_version()
        events = self.service.decode(request_id, kv, sampling, list(body.token_ids),  # the prompt: for penalties
                                     weight_version=version)
        first = await anext(events)
        return output_deltas(first, events, version or None)

    @endpoint
    async def chat(self, request: Request) -> Response:
        """llm-d's OpenAI-format decode call: the client's chat + the prefill's kv_transfer_params; the
        answer (JSON or SSE) is OpenAI's, built as the coordinator builds its own."""
        return await self._openai(request, "chat")

    @endpoint
    async def completion(self, request: Request) -> Response:
        """llm-d's completions-path decode call: the client's completion (prompt: token ids) + kv_transfer_params."""
        return await self._openai(request, "completion")

    async def _openai(self, request: Request, kind: Literal["chat", "completion"]) -> Response:
        call = await openai_call(request, self.render, lambda _: "none", kind)  # decode needs the token ids only
        body = call.generate
        deltas = await self._decode(body, header_request_id(request) or body.request_id, kind)
        built = OpenAIAnswer(kind, body.request_id, body.model or self.model_id, None, len(body.token_ids),
                             call.include_usage, list(body.token_ids) if call.body.get("return_token_ids") is True
                             else None, samples=body.sampling_params.n)
        if body.stream:
            return sse_response(built.sse(deltas))
        return JSONResponse(await built.collect(deltas))

    @endpoint
    async def abort(self, request: Request) -> Response:
        body = await parse_body(request, AbortRequest)
        ids = [r.removeprefix(RESPONSE_ID_PREFIX) for r in body.request_ids]
        return JSONResponse({"aborted": self.service.abort(ids)})


def routes(service: DecodeService, model_id: str, render: RenderClient | None = None) -> list[Route]:
    api = DecodeApi(service, model_id, render or RenderClient([]))
    return [Route("/inference/v1/generate", api.generate, methods=["POST"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completion, methods=["POST"]),
            Route("/abort_requests", api.abort, methods=["POST"])]
