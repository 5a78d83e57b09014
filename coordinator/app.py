"""The coordinator's HTTP API (starlette): OpenAI endpoints over the E/P/D pipeline.

Routes only parse, call the pipeline and map errors (services.protocol.errors)
to HTTP; the pipeline holds the logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.config import EpdConfig
from services.observability import request_id_var
from services.protocol.errors import EpdError, InvalidRequest, as_epd_error
from services.protocol.parsing import parse_json

from .admission import AdmissionMiddleware
from .cluster import Cluster
from .context import RequestContext
from .control_api import ControlApi
from .inflight import InflightRegistry
from .openai_api import collect, stream_events
from .openapi import OpenApiRoute
from .pipeline import Pipeline

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024 * 1024
BODY_READ_TIMEOUT_S = 30.0


def error_response(err: EpdError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(err.retry_after_s)))} if err.retry_after_s else None
    return JSONResponse(err.to_body(), status_code=err.status, headers=headers)


async def _read_body(request: Request) -> bytearray:
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > MAX_BODY_BYTES:
            raise InvalidRequest(f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large")
    return raw


async def read_json(request: Request) -> tuple[bytes, dict[str, Any]]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise InvalidRequest(f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:  # a client trickling its body must not hold a request slot for ever
        raw = await asyncio.wait_for(_read_body(request), BODY_READ_TIMEOUT_S)
    except TimeoutError:
        raise InvalidRequest(f"request body not received within {BODY_READ_TIMEOUT_S:g} s",
                             code="body_timeout") from None
    try:
        body = parse_json(raw)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return bytes(raw), body


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise InvalidRequest("stream: must be a boolean", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options: must be an object", code="invalid_type")
    return bool(stream), bool(options.get("include_usage"))


class CoordinatorApp:
    def __init__(self, config: EpdConfig) -> None:
        self.config = config
        self.cluster = Cluster(config)
        self.pipeline = Pipeline(self.cluster)
        self.inflight = InflightRegistry()

    def new_context(self, request: Request, kind: str, raw: bytes, body: dict[str, Any]) -> RequestContext:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        stream, include_usage = _stream_flags(body)
        ctx = RequestContext(request_id=request_id, kind=kind, body=raw, stream=stream,
                             include_usage=include_usage,
                             deadline=time.monotonic() + self.config.request_timeout_s)
        ctx.extra["return_token_ids"] = body.get("return_token_ids") is True
        return ctx

    async def openai(self, request: Request, kind: str) -> Response:
        endpoint = request.url.path
        try:
            raw, body = await read_json(request)
            ctx = self.new_context(request, kind, raw, body)
            request_id_var.set(ctx.request_id)
            await self.pipeline.prepare(ctx)
            chunks = self.pipeline.stream(ctx)
            if ctx.stream:
                self.cluster.metrics.requests.labels(endpoint, "200").inc()
                return StreamingResponse(stream_events(ctx, chunks), media_type="text/event-stream",
                                         headers={"X-Request-Id": ctx.request_id})
            answer = await collect(ctx, chunks)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - mapped to one error taxonomy
            err = as_epd_error(exc)
            if err.status >= 500:
                log.exception("request failed")
            self.cluster.metrics.requests.labels(endpoint, str(err.status)).inc()
            self.cluster.metrics.errors.labels(endpoint, err.code).inc()
            return error_response(err)
        self.cluster.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(answer, headers={"X-Request-Id": ctx.request_id})

    async def chat(self, request: Request) -> Response:
        return await self.openai(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.openai(request, "completion")

    async def models(self, _: Request) -> Response:
        card = {"id": self.config.served_model_id(), "object": "model", "created": 0, "owned_by": "epd",
                "max_model_len": self.config.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, _: Request) -> Response:
        roles = {pool.role: len(pool.healthy()) for pool in self.cluster.pools}
        # A text-only model runs no encoders (none configured): an empty encode pool is then fine.
        optional = set() if self.config.urls("encode") else {"encode"}
        ok = all(count for role, count in roles.items() if role not in optional)
        return JSONResponse({"status": "ok" if ok else "degraded", "healthy_instances": roles},
                            status_code=200 if ok else 503)

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def routes(self) -> list[Route]:
        from .generate_api import GenerateApi  # imports this module: bind late

        return [
            *GenerateApi(self).routes(),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            *ControlApi(self.cluster, self.inflight).routes(),
            Route("/openapi.json", OpenApiRoute(f"epd coordinator ({self.config.served_model_id()})").serve,
                  methods=["GET"]),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        self.cluster.start()
        try:
            yield
        finally:
            await self.cluster.close()

    def build(self) -> Starlette:
        admission = Middleware(AdmissionMiddleware, registry=self.inflight, metrics=self.cluster.metrics,
                               max_inflight=self.config.max_inflight_requests, saturated=self.decode_saturated,
                               max_request_s=self.config.request_timeout_s + BODY_READ_TIMEOUT_S + 5.0)
        return Starlette(routes=self.routes(), lifespan=self.lifespan, middleware=[admission])

    def decode_saturated(self) -> str | None:
        """Why no new request can start now, or None.

        Every running request will hold one decode stream; admitting no more than the healthy decode
        instances have slots + queue for means decode never refuses a request that was already
        rendered, encoded and prefilled (whose KV would then wait for its TTL).
        """
        per_instance = self.config.decode_slots + self.config.decode_queue
        healthy = len(self.cluster.decode.healthy()) if hasattr(self.cluster, "decode") else 0
        if healthy and len(self.inflight) >= healthy * per_instance:
            return (f"the decode instances are full ({healthy} x {per_instance} slots + queue); "
                    "retry later")
        return None
