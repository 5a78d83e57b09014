"""The coordinator's HTTP app (starlette): wiring only.

One place lists every route table (`routes`) and every middleware
(`middleware`, outermost first), so a concern that wraps all routes (API
keys, request ids, deadlines) is one entry there.  The route modules import
the pipeline, never this module:

    app.py ─▶ openai_api.py, generate_api.py, control_api.py, openapi.py ─▶ pipeline.py ─▶ steps/ ─▶ clients.py

The generation POSTs are served by direct.py under the same drain and admission middleware, without
Starlette's other layers; everything else goes through the Starlette app.

The public app sits behind the API keys (services.edge.auth: every route but
PROBE_PATHS); the control routes are not on it (404) but on the admin app
(admin.py), served on --admin-host/--admin-port.

Probes: GET /health is liveness (200 while the process serves HTTP), GET /ready readiness (200 only
when every role has a ready instance, probed now, and no drain is running); both, and /metrics, are
services.runtime.server.PROBE_PATHS: open whatever authentication wraps the rest.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.config import EpdConfig
from services.edge.auth import protect
from services.runtime.server import PROBE_PATHS, route_table

from .admin import build_admin_app
from .admission import GENERATION_PATHS, AdmissionMiddleware
from .cluster import Cluster
from .direct import DirectRoutes
from .drain import Drain, DrainMiddleware
from .errors_http import JSON_ERRORS
from .generate_api import GenerateApi
from .inflight import InflightRegistry
from .openai_api import OpenAIApi
from .openapi import OpenApiRoute
from .pipeline import Pipeline
from .slo_gate import SloGate

log = logging.getLogger(__name__)


class CoordinatorApp:
    def __init__(self, config: EpdConfig) -> None:
        self.config = config
        self.cluster = Cluster(config)
        self.pipeline = Pipeline(self.cluster)
        self.inflight = InflightRegistry()
        self.drain = Drain(self.inflight, config.server.shutdown_grace_s)
        limits = config.limits   # one gate for both copies of the middleware (build)
        self.slo_gate = SloGate(limits.ttft_slo_ms / 1000, limits.tpot_slo_ms / 1000) \
            if limits.ttft_slo_ms > 0 or limits.tpot_slo_ms > 0 else None
        self.generate_api = GenerateApi(config, self.cluster, self.pipeline)
        self.openai_api = OpenAIApi(config, self.cluster, self.pipeline)

    async def models(self, _: Request) -> Response:
        card = {"id": self.config.checkpoint.served_model_id(), "object": "model", "created": 0, "owned_by": "epd",
                "max_model_len": self.cluster.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    def _required(self) -> list[str]:
        # A text-only model runs no encoders (none configured): an empty encode pool is then fine.
        optional = set() if self.config.cluster.urls("encode") else {"encode"}
        return [pool.role for pool in self.cluster.pools if pool.role not in optional or pool.instances]

    async def health(self, _: Request) -> Response:
        """Liveness; the body also says what routing sees now (instances taking work per role)."""
        roles = {pool.role: len(pool.healthy()) for pool in self.cluster.pools}
        ok = all(roles[role] for role in self._required())
        return JSONResponse({"status": "ok", "ready": ok and not self.drain.draining, "healthy_instances": roles})

    async def ready(self, _: Request) -> Response:
        """Readiness: every needed role has an instance that answers SERVING to a probe made now."""
        probes = {pool.role: await pool.check_all() for pool in self.cluster.pools}
        ready = {role: sum(results.values()) for role, results in probes.items()}
        problems = ["draining for shutdown"] if self.drain.draining else []
        for role in self._required():
            if not ready[role]:
                known = len(probes[role])
                problems.append(f"no ready {role} instance ({known} known; GET /ready on each says why)"
                                if known else f"no {role} instance is configured or registered")
        return JSONResponse({"status": "not_ready" if problems else "ready", "ready_instances": ready,
                             "problems": problems, "instance_id": self.config.server.instance_id},
                            status_code=503 if problems else 200)

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def routes(self) -> list[Route]:
        title = f"epd coordinator ({self.config.checkpoint.served_model_id()})"
        return [
            *self.generate_api.routes(),
            *self.openai_api.routes(),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", OpenApiRoute(title).serve, methods=["GET"]),
        ]

    def middleware(self) -> list[Middleware]:
        """Outermost first."""
        limits = self.config.limits
        return [Middleware(DrainMiddleware, drain=self.drain),
                Middleware(AdmissionMiddleware, registry=self.inflight, metrics=self.cluster.metrics,
                           max_inflight=limits.max_inflight_requests, saturated=self.decode_saturated,
                           max_request_s=limits.max_request_timeout_s + limits.body_read_timeout_s + 5.0,
                           send_stall_s=limits.stream_idle_timeout_s, gate=self.slo_gate)]

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        self.cluster.start()
        try:
            yield
        finally:
            await self.cluster.close()

    def build(self) -> Any:
        """The public app: routes and middleware, behind the API keys."""
        routes = self.routes()
        log.info("coordinator http routes: %s", json.dumps(route_table(routes)))
        app = Starlette(routes=routes, lifespan=self.lifespan, middleware=self.middleware(),
                        exception_handlers=JSON_ERRORS)
        # The generation routes skip Starlette's layers (direct.py); the same middleware guards them.
        direct = DirectRoutes(app, {route.path: route.endpoint for route in routes
                                    if route.path in GENERATION_PATHS and "POST" in (route.methods or ())},
                              self.middleware())
        return protect(direct, self.config.security.api_keys(), PROBE_PATHS, "the coordinator API")

    def build_admin(self) -> Any:
        """The private control plane (admin.py), sharing this app's cluster and in-flight registry."""
        return build_admin_app(self.config, self.cluster, self.inflight)

    def decode_saturated(self) -> str | None:
        """Why no new request can start now, or None.

        Every running request will hold one decode stream; admitting no more than the healthy decode
        instances have slots + queue for means decode never refuses a request that was already
        rendered, encoded and prefilled (whose KV would then wait for its TTL).
        """
        per_instance = self.config.engines.decode_slots + self.config.engines.decode_queue
        healthy = len(self.cluster.decode.pool.healthy()) if hasattr(self.cluster, "decode") else 0
        if healthy and len(self.inflight) >= healthy * per_instance:
            return (f"the decode instances are full ({healthy} x {per_instance} slots + queue); "
                    "retry later")
        return None
