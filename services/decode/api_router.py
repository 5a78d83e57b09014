"""Decode's HTTP routes (PROTOCOL.md): POST /inference/v1/generate and POST /abort_requests.

Generate on decode means: kv_transfer_params from a prefill answer (+ sampling)
-> every output token, the first one (sampled by prefill) included, as one
GenerateResponse or as SSE (`data: <chunk>` with the token_ids delta, a usage
event with include_usage, errors in-stream as `data: {"error": ...}`, then
`data: [DONE]`).  Same DecodeService as gRPC.  Errors before the first event
(bad or missing KV handle, decode full) are plain HTTP errors; a client that
goes away mid-stream aborts the request and frees its slot.

The engine runs the request under the caller's id (X-Request-Id, else
request_id); /abort_requests takes that id, with or without the
"generate-tokens-" prefix.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.http_api import (
    check_model,
    endpoint,
    header_request_id,
    model_response,
    parse_body,
    sse_response,
)
from services.protocol.common import Usage
from services.protocol.errors import EpdError, InternalError, InvalidRequest, as_epd_error
from services.protocol.generate import (
    RESPONSE_ID_PREFIX,
    AbortRequest,
    FinishReason,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChunk,
    response_id,
)
from services.protocol.streaming import SSE_DONE, sse_error, sse_event

from .serving import DecodeService
from .stream import DecodeEvent


def _finish(reason: str | None) -> FinishReason | None:
    """The engine's finish reasons are exactly the protocol's (stop, length, abort, error)."""
    return cast(FinishReason | None, reason)


def _event_error(event: DecodeEvent) -> EpdError:
    return InternalError(event.error or "decode failed", code="decode_error")


class DecodeCall:
    """One generate call: the request, its ids and its running event stream."""

    def __init__(self, body: GenerateRequest, rsp_id: str, model: str, events: AsyncIterator[DecodeEvent],
                 first: DecodeEvent) -> None:
        self.body, self.rsp_id, self.model, self.events, self.first = body, rsp_id, model, events, first
        kv = body.kv_transfer_params or {}
        self.prompt_tokens = int(kv.get("num_prompt_tokens") or len(body.token_ids))

    async def all_events(self) -> AsyncIterator[DecodeEvent]:
        try:
            yield self.first
            if not self.first.finished:
                async for event in self.events:
                    yield event
        finally:
            close = getattr(self.events, "aclose", None)
            if close is not None:
                await close()  # now, not at garbage collection: an early exit frees the slot at once

    def usage(self, completion_tokens: int) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens)

    async def collect(self) -> GenerateResponse:
        tokens: list[int] = []
        last = self.first
        async for event in self.all_events():
            if event.finish_reason == "error":
                raise _event_error(event)
            tokens.extend(event.token_ids)
            last = event
        choice = GenerateChoice(token_ids=tokens, finish_reason=_finish(last.finish_reason or "abort"),
                                stop_reason=last.stop_reason)
        return GenerateResponse(request_id=self.rsp_id, model=self.model, choices=[choice],
                                usage=self.usage(len(tokens)))

    async def sse(self) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        count = 0
        try:
            async for event in self.all_events():
                if event.finish_reason == "error":
                    raise _event_error(event)
                count += len(event.token_ids)
                if event.token_ids or event.finished:
                    yield sse_event(self._chunk(event, count, continuous))
            if options is not None and options.include_usage:
                yield sse_event(GenerateStreamChunk(request_id=self.rsp_id, model=self.model, choices=[],
                                                    usage=self.usage(count)))
        except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-stream
            yield sse_error(as_epd_error(exc))
        yield SSE_DONE

    def _chunk(self, event: DecodeEvent, count: int, with_usage: bool) -> GenerateStreamChunk:
        choice = GenerateChoice(token_ids=list(event.token_ids), finish_reason=_finish(event.finish_reason),
                                stop_reason=event.stop_reason)
        return GenerateStreamChunk(request_id=self.rsp_id, model=self.model, choices=[choice],
                                   usage=self.usage(count) if with_usage else None)


class DecodeApi:
    def __init__(self, service: DecodeService, model_id: str) -> None:
        self.service, self.model_id = service, model_id

    @endpoint
    async def generate(self, request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        check_model(body.model, self.model_id)
        if body.kv_transfer_params is None:
            raise InvalidRequest("decode needs kv_transfer_params (from a prefill answer)",
                                 code="missing_kv_transfer_params")
        header = header_request_id(request)
        sampling = body.sampling_params.model_dump(exclude={"extra_args"})
        events = self.service.decode(header or body.request_id, body.kv_transfer_params, sampling,
                                     list(body.token_ids))  # the prompt, for repetition penalties
        first = await anext(events)  # before any byte is sent: setup errors become plain HTTP errors
        rsp_id = response_id(body.request_id, header)
        call = DecodeCall(body, rsp_id, body.model or self.model_id, events, first)
        if body.stream:
            return sse_response(call.sse())
        return model_response(await call.collect())

    @endpoint
    async def abort(self, request: Request) -> Response:
        body = await parse_body(request, AbortRequest)
        ids = [r.removeprefix(RESPONSE_ID_PREFIX) for r in body.request_ids]
        return JSONResponse({"aborted": self.service.abort(ids)})


def routes(service: DecodeService, model_id: str) -> list[Route]:
    api = DecodeApi(service, model_id)
    return [Route("/inference/v1/generate", api.generate, methods=["POST"]),
            Route("/abort_requests", api.abort, methods=["POST"])]
