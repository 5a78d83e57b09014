"""The coordinator's HTTP app (starlette): wiring only.

One place lists every route table (`routes`) and every middleware
(`middleware`, outermost first), so a concern that wraps all routes (API
keys, request ids, deadlines) is one entry there.  The route modules import
the pipeline, never this module:

    app.py ─▶ openai_api.py, generate_api.py, control_api.py, openapi.py ─▶ pipeline.py ─▶ steps/ ─▶ clients.py
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.config import EpdConfig

from .admission import AdmissionMiddleware
from .cluster import Cluster
from .control_api import ControlApi
from .generate_api import GenerateApi
from .http_io import BODY_READ_TIMEOUT_S
from .inflight import InflightRegistry
from .openai_api import OpenAIApi
from .openapi import OpenApiRoute
from .pipeline import Pipeline


class CoordinatorApp:
    def __init__(self, config: EpdConfig) -> None:
        self.config = config
        self.cluster = Cluster(config)
        self.pipeline = Pipeline(self.cluster)
        self.inflight = InflightRegistry()

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
        title = f"epd coordinator ({self.config.served_model_id()})"
        return [
            *GenerateApi(self.config, self.cluster, self.pipeline).routes(),
            *OpenAIApi(self.config, self.cluster, self.pipeline).routes(),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            *ControlApi(self.cluster, self.inflight).routes(),
            Route("/openapi.json", OpenApiRoute(title).serve, methods=["GET"]),
        ]

    def middleware(self) -> list[Middleware]:
        """Outermost first."""
        return [Middleware(AdmissionMiddleware, registry=self.inflight, metrics=self.cluster.metrics,
                           max_inflight=self.config.max_inflight_requests, saturated=self.decode_saturated,
                           max_request_s=self.config.request_timeout_s + BODY_READ_TIMEOUT_S + 5.0)]

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        self.cluster.start()
        try:
            yield
        finally:
            await self.cluster.close()

    def build(self) -> Starlette:
        return Starlette(routes=self.routes(), lifespan=self.lifespan, middleware=self.middleware())

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
