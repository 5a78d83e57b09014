"""The coordinator's scale-out routes: POST /inference/v1/generate and GET /cluster.

Generate runs the whole pipeline for a GenerateRequest on any of its three
input paths (steps/generate_input.py) and answers like a decode instance
(generate_answer.py).  The response id is "generate-tokens-<id>", <id> being
the X-Request-Id header when given, else request_id; <id> is also the id every
stage sees.

/cluster lists every role instance as {"role", "http_url", "grpc_address",
"healthy"} (healthy: a gRPC health probe made now), so an operator or an
external orchestrator can find the roles and drive them over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.observability import request_id_var
from services.protocol.errors import as_epd_error
from services.protocol.generate import GenerateRequest, response_id
from services.protocol.parsing import validate_model
from services.protocol.streaming import SSE_MEDIA_TYPE

from .app import CoordinatorApp, error_response, read_json
from .context import RequestContext
from .generate_answer import GenerateAnswer
from .routing.pool import InstancePool

log = logging.getLogger(__name__)
ENDPOINT = "/inference/v1/generate"


class GenerateApi:
    def __init__(self, app: CoordinatorApp) -> None:
        self.app = app
        self.cluster = app.cluster

    def _context(self, request: Request, req: GenerateRequest) -> RequestContext:
        header = request.headers.get("x-request-id") or None
        ctx = RequestContext(request_id=header or req.request_id, kind="generate", stream=req.stream,
                             deadline=time.monotonic() + self.app.config.request_timeout_s)
        ctx.generate = req
        return ctx

    async def generate(self, request: Request) -> Response:
        try:
            _, body = await read_json(request)
            req = validate_model(GenerateRequest, body)
            ctx = self._context(request, req)
            request_id_var.set(ctx.request_id)
            await self.app.pipeline.prepare(ctx)
            model = req.model or self.app.config.served_model_id()
            rsp_id = response_id(req.request_id, request.headers.get("x-request-id"))
            answer = GenerateAnswer(ctx, rsp_id, model)
            chunks = self.app.pipeline.stream(ctx)
            headers = {"X-Request-Id": ctx.request_id}
            if req.stream:
                self._count("200")
                return StreamingResponse(answer.sse(chunks), media_type=SSE_MEDIA_TYPE, headers=headers)
            result = await answer.collect(chunks)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - mapped to one error taxonomy
            err = as_epd_error(exc)
            if err.status >= 500:
                log.exception("generate failed")
            self._count(str(err.status))
            self.cluster.metrics.errors.labels(ENDPOINT, err.code).inc()
            return error_response(err)
        self._count("200")
        return Response(result.model_dump_json(), media_type="application/json", headers=headers)

    def _count(self, status: str) -> None:
        self.cluster.metrics.requests.labels(ENDPOINT, status).inc()

    async def cluster_info(self, _: Request) -> Response:
        pools = self.cluster.pools
        probes = await asyncio.gather(*(pool.check_all() for pool in pools))
        instances = [entry for pool, health in zip(pools, probes, strict=True)
                     for entry in self._entries(pool, health)]
        return JSONResponse({"model": self.app.config.served_model_id(), "instances": instances})

    def _entries(self, pool: InstancePool, health: dict[str, bool]) -> list[dict[str, Any]]:
        # http_url: from --<role>-http-urls, or as the instance announced itself (POST /v1/instances).
        return [{"role": pool.role, "http_url": instance.http_url or None,
                 "grpc_address": instance.address, "healthy": health.get(instance.address, False)}
                for instance in pool.instances]

    def routes(self) -> list[Route]:
        return [Route(ENDPOINT, self.generate, methods=["POST"]),
                Route("/cluster", self.cluster_info, methods=["GET"])]
