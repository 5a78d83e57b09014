"""Starlette glue every role's api_router shares: bodies in, models out, errors mapped once.

A route is `@endpoint async def handler(request) -> Response`: the wrapper binds
the request id for logging (X-Request-Id, else a fresh one) and turns any
exception into the error body of services.protocol.errors with its status, so
handlers only parse, call their role's core and answer.  Streaming answers use
`sse_response`; errors raised after the first byte travel in-stream (the
generator handles them, see decode's router).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import Counter
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.observability import request_id_var
from services.protocol.errors import EpdError, InvalidRequest, NotFound, PayloadTooLarge, as_epd_error
from services.protocol.parsing import parse_model
from services.protocol.streaming import SSE_MEDIA_TYPE

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
# A render answer with a few large images is tens of MB of base64; gRPC allows the same.
MAX_BODY_BYTES = 256 * 1024 * 1024
# How long an idle keep-alive connection stays open (uvicorn's default is 5 s, vLLM's too).  A client pool keeps its
# idle connections longer (vllm bench serve 60 s, aiohttp 15 s): a request sent on one just as the server closes it
# fails with "server disconnected" before it reaches the server (`vllm bench serve` lost requests that way).
# Longer than those pools, the server never closes a connection a client may still pick; an idle connection costs
# one socket.
KEEP_ALIVE_S = 75
Handler = Callable[..., Awaitable[Response]]
HTTP_REQUESTS = Counter("epd_http_requests", "HTTP API calls served by route and result code (ok or the epd "
                        "error code)", ["path", "code"])


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, refused past `limit` bytes before it is all read."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body over {limit} bytes", code="body_too_large")
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes", code="body_too_large")
    return bytes(raw)


async def parse_body(request: Request, cls: type[M]) -> M:
    return parse_model(cls, await read_body(request))


def header_request_id(request: Request) -> str | None:
    return request.headers.get("x-request-id") or None


# Errors answered before the request's body was read to its end: the connection cannot carry another request
# (the rest of the body would be read as one), so the answer closes it; a trickling client is dropped.
BODY_UNREAD_CODES = frozenset({"body_timeout", "body_too_large"})


def error_response(err: EpdError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(err.retry_after_s)))} if err.retry_after_s else {}
    if err.code in BODY_UNREAD_CODES:
        headers["Connection"] = "close"
    return JSONResponse(err.to_body(), status_code=err.status, headers=headers or None)


def model_response(model: BaseModel | list[BaseModel], headers: dict[str, str] | None = None) -> Response:
    """A model (or a list of them) as JSON, serialized by pydantic (aliases and nulls as declared)."""
    if isinstance(model, list):
        body = "[" + ",".join(m.model_dump_json() for m in model) + "]"
    else:
        body = model.model_dump_json()
    return Response(body, media_type="application/json", headers=headers)


def sse_response(events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(events, media_type=SSE_MEDIA_TYPE, headers=headers)


def check_model(model: str | None, served: str) -> None:
    """None passes; otherwise it must be the served model id (same message as render's check)."""
    if model is not None and model != served:
        raise NotFound(f"The model `{model}` does not exist (served: {served})", code="model_not_found")


def check_tokens_mode(output_mode: str, role: str) -> None:
    """Encode and prefill answer transfer handles, not text: output_mode 'text' is decode's and the coordinator's."""
    if output_mode != "tokens":
        raise InvalidRequest(f"{role} answers output_mode 'tokens' only; output_mode {output_mode!r} is served "
                             "by decode and the coordinator", code="unsupported_output_mode")


def endpoint(handler: Handler) -> Handler:
    """Bind the request id for logs and map every failure to one error answer."""
    @functools.wraps(handler)
    async def wrapper(*args: Any) -> Response:  # (request) or (self, request)
        request: Request = args[-1]
        request_id_var.set(header_request_id(request) or "-")
        try:
            response = await handler(*args)
        except ClientDisconnect:
            HTTP_REQUESTS.labels(request.url.path, "client_gone").inc()
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - mapped to the one error taxonomy
            err = as_epd_error(exc)
            if err.status >= 500:
                log.exception("request failed")
            HTTP_REQUESTS.labels(request.url.path, err.code).inc()
            return error_response(err)
        HTTP_REQUESTS.labels(request.url.path, "ok").inc()
        return response

    return wrapper
