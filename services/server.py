"""Runs one role process: a gRPC server and an HTTP server in one event loop.

Both transports are thin adapters over the role's core.  The HTTP side always
serves GET /health and GET /metrics; the gRPC side always serves the standard
health protocol.  SIGTERM and SIGINT stop both servers gracefully (bounded
grace period), then run the role's cleanup (freeing shm segments, Redis keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
]
# The coordinator pings while calls run (keepalive) to find peers that vanished silently; allow it.
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 4000),
    ("grpc.http2.max_ping_strikes", 0),
]
SHUTDOWN_GRACE_S = 3.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: this runner owns SIGTERM/SIGINT for both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class RoleServer:
    """What a role plugs into the runner."""

    name: str
    register_grpc: Callable[[grpc.aio.Server], None]
    http_routes: list[Route] = field(default_factory=list)
    is_ready: Callable[[], bool] = lambda: True
    cleanup: Callable[[], Awaitable[None] | None] = lambda: None
    health_details: Callable[[], dict] = dict


def build_http_app(role: RoleServer) -> Starlette:
    async def health_route(_: Request) -> Response:
        ok = role.is_ready()
        body = {"status": "ok" if ok else "starting", "role": role.name, **role.health_details()}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics_route(_: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    routes = [Route("/health", health_route), Route("/metrics", metrics_route), *role.http_routes]
    return Starlette(routes=routes)


async def serve(role: RoleServer, host: str, grpc_port: int, http_port: int, log_level: str = "info") -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    role.register_grpc(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{grpc_port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    http = _QuietServer(uvicorn.Config(build_http_app(role), host=host, port=http_port,
                                       log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    log.info("%s serving: grpc %s:%d, http %s:%d", role.name, host, bound, host, http_port)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({stopped, http_task}, return_when=asyncio.FIRST_COMPLETED)
    log.info("%s stopping", role.name)
    await health_servicer.enter_graceful_shutdown()
    http.should_exit = True
    await server.stop(SHUTDOWN_GRACE_S)
    await asyncio.wait({http_task}, timeout=SHUTDOWN_GRACE_S)
    result = role.cleanup()
    if asyncio.iscoroutine(result):
        await result
    log.info("%s stopped", role.name)
