"""The coordinator's OpenAI routes: POST /v1/chat/completions and /v1/completions over the pipeline.

Routes only read the body, build the RequestContext, run the pipeline and
hand its output deltas to the one answer builder (services.protocol.answers);
the pipeline holds the logic, http_io.answer maps errors once.  Response ids
are "chatcmpl-<id>" / "cmpl-<id>", <id> being X-Request-Id when given (a label: request_ids.py).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services import activity
from services.auth import principal
from services.config import EpdConfig
from services.observability import request_id_var
from services.protocol.answers import OpenAIAnswer
from services.protocol.request_metrics import RequestTiming
from services.protocol.streaming import SSE_MEDIA_TYPE

from .cluster import Cluster
from .context import Kind, RequestContext
from .deadlines import HEADER as DEADLINE_HEADER
from .deadlines import Deadlines
from .http_io import BodyLimits, answer, read_json, stream_flags
from .pipeline import Pipeline
from .request_ids import internal_id, label_of


def openai_answer(ctx: RequestContext, timing: RequestTiming | None = None) -> OpenAIAnswer:
    assert ctx.rendered is not None and ctx.kind != "generate"
    prefix = "chatcmpl-" if ctx.kind == "chat" else "cmpl-"
    return OpenAIAnswer(ctx.kind, prefix + ctx.label, ctx.rendered.model, ctx.created, ctx.prompt_tokens(),
                        ctx.include_usage, list(ctx.rendered.token_ids) if ctx.return_token_ids else None,
                        timing)


class OpenAIApi:
    def __init__(self, config: EpdConfig, cluster: Cluster, pipeline: Pipeline) -> None:
        self.config, self.cluster, self.pipeline = config, cluster, pipeline

    def context(self, request: Request, kind: Kind, raw: bytes, body: dict[str, Any]) -> RequestContext:
        stream, include_usage = stream_flags(body)
        label = label_of(request.headers.get("x-request-id"))
        bounds = Deadlines.for_request(self.config, request.headers.get(DEADLINE_HEADER))
        return RequestContext(request_id=internal_id(label), label=label, principal=principal(request.scope),
                              kind=kind, body=raw, stream=stream, include_usage=include_usage,
                              return_token_ids=body.get("return_token_ids") is True, deadline=bounds.first_token,
                              total_deadline=bounds.total, idle_s=bounds.idle_s,
                              max_retries=self.config.max_retries)

    async def _run(self, request: Request, kind: Kind) -> Response:
        arrived = time.monotonic()
        activity.mark("coordinator.http_in")
        raw, body = await read_json(request, BodyLimits.of(self.config))
        ctx = self.context(request, kind, raw, body)
        request_id_var.set(ctx.request_id)
        timing = RequestTiming(arrived, time.monotonic()) if self.config.enable_per_request_metrics else None
        await self.pipeline.prepare(ctx)
        deltas, built = self.pipeline.stream(ctx), openai_answer(ctx, timing)
        headers = {"X-Request-Id": ctx.label}
        if ctx.stream:
            return StreamingResponse(built.sse(deltas), media_type=SSE_MEDIA_TYPE, headers=headers)
        return JSONResponse(await built.collect(deltas), headers=headers)

    async def chat(self, request: Request) -> Response:
        return await answer(self.cluster.metrics, request.scope["path"], lambda: self._run(request, "chat"))

    async def completions(self, request: Request) -> Response:
        return await answer(self.cluster.metrics, request.scope["path"], lambda: self._run(request, "completion"))

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"])]
