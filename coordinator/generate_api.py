"""The coordinator's scale-out routes: POST /inference/v1/generate and GET /cluster.

Generate runs the whole pipeline for a GenerateRequest on any of its three
input paths (steps/generate_input.py) and answers like a decode instance
(services.protocol.answers.GenerateAnswer).  The response id is
"generate-tokens-<id>", <id> being the X-Request-Id header when given, else
request_id; <id> is a label (request_ids.py): stages see a unique internal id.

/cluster lists every role instance as {"role", "http_url", "grpc_address",
"healthy"} (healthy: a gRPC health probe made now), so an operator or an
external orchestrator can find the roles and drive them over HTTP.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.config import EpdConfig
from services.edge.auth import principal
from services.observability import request_id_var
from services.protocol.answers import GenerateAnswer
from services.protocol.generate import GenerateRequest, response_id
from services.protocol.parsing import validate_model
from services.protocol.streaming import SSE_MEDIA_TYPE

from .cluster import Cluster
from .context import RequestContext
from .deadlines import HEADER as DEADLINE_HEADER
from .deadlines import Deadlines
from .http_io import BodyLimits, answer, off_loop, read_json_sized
from .pipeline import Pipeline
from .request_ids import internal_id, label_of
from .routing.pool import InstancePool

ENDPOINT = "/inference/v1/generate"


class GenerateApi:
    def __init__(self, config: EpdConfig, cluster: Cluster, pipeline: Pipeline) -> None:
        self.config, self.cluster, self.pipeline = config, cluster, pipeline

    def context(self, request: Request, req: GenerateRequest) -> RequestContext:
        label = label_of(request.headers.get("x-request-id"), req.request_id)
        bounds = Deadlines.for_request(self.config, request.headers.get(DEADLINE_HEADER))
        return RequestContext(request_id=internal_id(label), label=label, principal=principal(request.scope),
                              kind="generate", stream=req.stream, generate=req, deadline=bounds.first_token,
                              total_deadline=bounds.total, idle_s=bounds.idle_s,
                              max_retries=self.config.cluster.max_retries)

    async def _run(self, request: Request) -> Response:
        size, body = await read_json_sized(request, BodyLimits.of(self.config))
        req = await off_loop(size, lambda: validate_model(GenerateRequest, body))
        ctx = self.context(request, req)
        request_id_var.set(ctx.request_id)
        await self.pipeline.prepare(ctx)
        built = GenerateAnswer(response_id(req.request_id, request.headers.get("x-request-id")),
                               req.model or self.config.checkpoint.served_model_id(), ctx.prompt_tokens(),
                               req.stream_options, ctx.created, req.output_mode, req.sampling_params.n,
                               ctx.prompt_logprobs(), self.config.cluster.return_tokens_as_token_ids)
        deltas = self.pipeline.stream(ctx)
        headers = {"X-Request-Id": ctx.label}
        if req.stream:
            return StreamingResponse(built.sse(deltas), media_type=SSE_MEDIA_TYPE, headers=headers)
        result = await built.collect(deltas)
        return Response(result.model_dump_json(), media_type="application/json", headers=headers)

    async def generate(self, request: Request) -> Response:
        return await answer(self.cluster.metrics, ENDPOINT, lambda: self._run(request))

    async def cluster_info(self, _: Request) -> Response:
        pools = self.cluster.pools
        probes = await asyncio.gather(*(pool.check_all() for pool in pools))
        instances = [entry for pool, health in zip(pools, probes, strict=True)
                     for entry in self._entries(pool, health)]
        return JSONResponse({"model": self.config.checkpoint.served_model_id(), "instances": instances,
                             "capacity": self.cluster.capacity.plan()})

    def _entries(self, pool: InstancePool, health: dict[str, bool]) -> list[dict[str, Any]]:
        # http_url: from --<role>-http-urls, or as the instance announced itself (POST /v1/instances).
        return [{"role": pool.role, "http_url": instance.http_url or None,
                 "grpc_address": instance.address, "healthy": health.get(instance.address, False)}
                for instance in pool.instances]

    def routes(self) -> list[Route]:
        return [Route(ENDPOINT, self.generate, methods=["POST"]),
                Route("/cluster", self.cluster_info, methods=["GET"])]
