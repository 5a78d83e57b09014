"""The coordinator's HTTP entry: bounded, time-limited body reads, JSON parsing kept off the event loop,
and the one place a generation route's error becomes a status and a body (`answer`).

Every generation route reads its body here.  A body is refused past
--max-request-bytes: 413 at once when Content-Length says so (nothing is
read), else as soon as the bytes read pass it; and it must arrive within
--body-read-timeout-s, else 408 (a client trickling its body must not hold a
request slot for ever).  Bodies
over OFF_LOOP_BYTES (a features request with images is MBs of base64) are
parsed and validated in a worker thread, their long strings lifted out of the
parse (services/protocol/large_json.py: json.loads holds the GIL for the whole
body), so other requests' streams keep flowing while it runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from services.config import EpdConfig
from services.edge.http_api import error_response
from services.protocol.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, as_epd_error
from services.protocol.large_json import parse_json_large

from .metrics import CoordinatorMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")
OFF_LOOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    timeout_s: float

    @classmethod
    def of(cls, config: EpdConfig) -> BodyLimits:
        return cls(config.limits.max_request_bytes, config.limits.body_read_timeout_s)

    def too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body over {self.max_bytes} bytes (--max-request-bytes)", code="body_too_large")


async def _read_body(request: Request, limits: BodyLimits) -> bytearray:
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > limits.max_bytes:
            raise limits.too_large()
    return raw


async def read_body(request: Request, limits: BodyLimits) -> bytearray:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_bytes:
        raise limits.too_large()
    try:
        async with asyncio.timeout(limits.timeout_s):
            return await _read_body(request, limits)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {limits.timeout_s:g} s (--body-read-timeout-s)",
                             code="body_timeout") from None


def _json_object(raw: bytes | bytearray) -> dict[str, Any]:
    try:
        body = parse_json_large(raw)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return body


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """`work()` here when small, in a worker thread when `size` bytes would stall the loop."""
    return work() if size <= OFF_LOOP_BYTES else await asyncio.to_thread(work)


async def read_json(request: Request, limits: BodyLimits) -> tuple[bytes, dict[str, Any]]:
    """The raw body (as bytes: copied in the worker thread when large) and its JSON object."""
    buf = await read_body(request, limits)
    return await off_loop(len(buf), lambda: (bytes(buf), _json_object(buf)))


async def read_json_sized(request: Request, limits: BodyLimits) -> tuple[int, dict[str, Any]]:
    """The body's size and its JSON object, for a route that does not forward the body (no second copy)."""
    buf = await read_body(request, limits)
    return len(buf), await off_loop(len(buf), lambda: _json_object(buf))


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of an OpenAI body, type-checked."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise InvalidRequest("stream: must be a boolean", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options: must be an object", code="invalid_type")
    return bool(stream), bool(options.get("include_usage"))


async def answer(metrics: CoordinatorMetrics, endpoint: str, produce: Callable[[], Awaitable[Response]]) -> Response:
    """Run a generation route: its response, or its error mapped once to status and body; counted."""
    try:
        response = await produce()
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - mapped to one error taxonomy
        err = as_epd_error(exc)
        if err.status >= 500:
            log.exception("%s failed", endpoint)
        metrics.requests.labels(endpoint, str(err.status)).inc()
        metrics.errors.labels(endpoint, err.code).inc()
        return error_response(err)
    metrics.requests.labels(endpoint, "200").inc()
    return response
