"""Runs one role process: a gRPC server and an HTTP server in one event loop.

Both transports are thin adapters over the role's core.  The HTTP side always
serves GET /health (liveness: 200 while the process runs), GET /ready
(readiness, services.runtime.readiness: 200 only when it can serve, else 503 naming
why) and GET /metrics; the gRPC side serves the standard health protocol,
SERVING exactly when ready.  SIGTERM and SIGINT drain: readiness turns false
at once, calls already running get up to `shutdown_grace_s` to finish, then
both servers stop and the role's cleanup runs (freeing shm segments, Redis keys).
With API keys (services.edge.auth) every HTTP route but PROBE_PATHS needs one; the
gRPC side (health included) is for the cluster's own calls: keep it on a
private network (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.edge.auth import KeySet, protect
from services.edge.http_api import KEEP_ALIVE_S
from services.rpc.fastlane_server import FastLaneServer
from services.runtime.announce import probed
from services.runtime.private_dir import private_dir
from services.runtime.readiness import Readiness

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
    # gRPC binds with SO_REUSEPORT by default: two servers handed the same port would both bind it and the
    # kernel would spread one cluster's calls over the other's role ("Method not found!"; seen in CI, two
    # clusters starting at once).  Without it the second bind fails loudly.
    ("grpc.so_reuseport", 0),
]
SHUTDOWN_GRACE_S = 3.0
DEREGISTER_S = 1.0   # five coordinator probe intervals (coordinator/routing/pool.py PROBE_INTERVAL_S = 0.2)
# Probe routes (liveness, readiness, metrics): never behind authentication, whatever middleware is added.
PROBE_PATHS = ("/health", "/ready", "/metrics")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a server that binds it later (`epd serve` hands its children
    their ports before they load their models, seconds later).

    Taken below the kernel's ephemeral range where there is room: a port from that range (what binding port
    0 gives) can be taken meanwhile by any outgoing connection's local end -- a test's HTTP client, a gRPC
    channel -- and the child then fails with "Address already in use" (seen in the suite).  Ports handed out
    by this process are not handed out again, nor, for CLAIM_TTL_S, by another process of this user on this
    machine (a claim file each): two `epd serve` starting at once handed the same port to two children, which
    both bound it before `so_reuseport` was turned off."""
    low = _ephemeral_low()
    candidates = range(max(_MIN_PORT, low - _SPAN), low)
    if len(candidates) >= 1000:
        for port in _RNG.sample(candidates, 64):
            if port not in _HANDED_OUT and _bindable(host, port) and _claim(port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


_MIN_PORT, _SPAN = 10000, 12000
_HANDED_OUT: set[int] = set()
_RNG = random.SystemRandom()   # not the global generator, which a test or a library may have seeded
CLAIM_TTL_S = 600.0   # how long a port handed out by one process is not handed out by another
_MAX_CLAIMS = 512     # past this many claim files, the stale ones are removed (bounded directory)


def _claim(port: int) -> bool:
    """Claim `port` across this user's processes: False while another process's claim is fresh.  Where the
    claim directory cannot be used (a read-only temp dir), True: this process's own bookkeeping remains."""
    try:
        folder = private_dir("epd-port-claims")   # another user's folder is refused: never theirs to steer
        path = folder / str(port)
        for _ in range(2):
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                return True
            except FileExistsError:
                try:
                    if time.time() - path.stat().st_mtime < CLAIM_TTL_S:
                        return False
                    path.unlink()   # stale: claimed again below
                except FileNotFoundError:
                    pass
        return False
    except OSError:
        return True
    finally:
        _prune_claims()


def _prune_claims() -> None:
    try:
        folder = private_dir("epd-port-claims")
        names = os.listdir(folder)
        if len(names) <= _MAX_CLAIMS:
            return
        now = time.time()
        for name in names:
            with contextlib.suppress(OSError):
                if now - (folder / name).stat().st_mtime >= CLAIM_TTL_S:
                    (folder / name).unlink()
    except OSError:
        pass


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768    # Linux's default; elsewhere the range is the OS's own, and this only a guess


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


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
    stores: list = field(default_factory=list)   # tensor stores whose backends readiness checks


def build_http_app(role: RoleServer, readiness: Readiness | None = None, keys: KeySet | None = None) -> Any:
    readiness = readiness or Readiness(role.name, role.is_ready, role.stores)

    async def health_route(_: Request) -> Response:  # liveness: the process and its event loop run
        body = {"status": "ok", "role": role.name, "ready": readiness.ready, **role.health_details()}
        return JSONResponse(body)

    async def ready_route(_: Request) -> Response:
        return JSONResponse(readiness.body(), status_code=200 if readiness.ready else 503)

    async def metrics_route(_: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    routes = [Route("/health", health_route), Route("/ready", ready_route), Route("/metrics", metrics_route),
              *role.http_routes]
    log.info("%s http routes: %s", role.name, json.dumps(route_table(routes)))
    return protect(Starlette(routes=routes), keys or KeySet(), PROBE_PATHS, f"the {role.name} HTTP API")


def route_table(routes: list[Any]) -> list[list[str]]:
    """[method, path] of every route (logged at start: what an operator, and the auth test, can call)."""
    return [[method, route.path] for route in routes for method in sorted(getattr(route, "methods", None) or ["GET"])
            if method != "HEAD"]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def serve(role: RoleServer, host: str, grpc_port: int, http_port: int, log_level: str = "info",
                grace_s: float = SHUTDOWN_GRACE_S, keys: KeySet | None = None, grpc_host: str = "",
                tls: grpc.ServerCredentials | None = None, fast_lane: bool = True, instance_id: str = "") -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    role.register_grpc(server)
    health_servicer = _ProbedHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    where = _address(grpc_host or host, grpc_port)
    bound = server.add_secure_port(where, tls) if tls is not None else server.add_insecure_port(where)
    readiness = Readiness(role.name, role.is_ready, role.stores)
    await readiness.refresh()
    await server.start()
    # The same methods over a Unix socket for a coordinator on this host (services/rpc/fastlane.py); not
    # beside TLS, whose peers expect their transport to be authenticated.
    fast = FastLaneServer.from_registration(role.register_grpc, bound, instance_id or str(os.getpid())) \
        if tls is None and fast_lane else None
    if fast is not None:
        try:
            await fast.start()
        except OSError as exc:   # e.g. the socket folder is not private (services/runtime/private_dir.py): gRPC only
            log.error("%s: no fast lane (%s); the coordinator reaches this role over gRPC", role.name, exc)
            fast = None
    await _set_serving(health_servicer, readiness.ready)
    http = _QuietServer(uvicorn.Config(build_http_app(role, readiness, keys), host=host, port=http_port,
                                       log_level="warning", lifespan="off", access_log=False,   # never printed
                                       timeout_keep_alive=KEEP_ALIVE_S,
                                       timeout_graceful_shutdown=math.ceil(grace_s)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    checks = asyncio.create_task(readiness.run(lambda ready: _set_serving(health_servicer, ready)))
    log.info("%s serving: grpc %s:%d (%s), http %s:%d", role.name, grpc_host or host, bound,
             "TLS" if tls is not None else "plaintext", host, http_port)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({stopped, http_task}, return_when=asyncio.FIRST_COMPLETED)
    started = loop.time()
    log.info("%s draining: not ready; new calls taken for %g s more (until the coordinator's probes see it), "
             "running ones get up to %g s to finish", role.name, min(DEREGISTER_S, grace_s), grace_s)
    readiness.draining = True
    checks.cancel()
    await health_servicer.enter_graceful_shutdown()
    # A call routed here just before the coordinator's next probe still arrives: take it for a moment.
    await asyncio.sleep(min(DEREGISTER_S, grace_s))
    http.should_exit = True
    left = max(0.0, grace_s - (loop.time() - started))
    await asyncio.gather(server.stop(left), *([fast.stop(left)] if fast is not None else []))
    await asyncio.wait({http_task}, timeout=max(0.1, grace_s - (loop.time() - started)))
    result = role.cleanup()
    if asyncio.iscoroutine(result):
        await result
    readiness.close()
    log.info("%s stopped after draining %.1f s", role.name, loop.time() - started)


class _ProbedHealth(health.aio.HealthServicer):
    """The standard health service, noting each probe (an announcing instance that goes unprobed announces again:
    services/runtime/announce.py)."""

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's method name
        probed()
        return await super().Check(request, context)


async def _set_serving(health_servicer: health.aio.HealthServicer, ready: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set("", status)
