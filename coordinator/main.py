"""Runs the coordinator process: the public app on --host/--port and the admin app on --admin-host/--admin-port.

One event loop serves both (they share the cluster and the in-flight
registry).  The public server owns SIGTERM/SIGINT and drains
(coordinator.drain); the admin server stops once the public one has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from services.config import EpdConfig
from services.edge.http_api import KEEP_ALIVE_S
from services.runtime import event_loop
from services.runtime.heap import keep_freed_memory, startup_done

from .app import CoordinatorApp
from .drain import DrainingServer

log = logging.getLogger(__name__)
AFTER_DRAIN_S = 2  # uvicorn's own wait for connections once the drain is over (idle keep-alives)


class _AdminServer(uvicorn.Server):
    """The admin server: no signal handling of its own (the public server drains and stops both)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve(public: DrainingServer, admin: _AdminServer, config: EpdConfig) -> None:
    admin_socket = admin.config.bind_socket()
    host, port = admin_socket.getsockname()[:2]
    log.info("coordinator admin API on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    admin_task = asyncio.create_task(admin.serve(sockets=[admin_socket]))
    try:
        await public.serve()
    finally:
        admin.should_exit = True
        await asyncio.wait({admin_task}, timeout=AFTER_DRAIN_S + 1)


def run_coordinator(config: EpdConfig) -> int:
    keep_freed_memory()   # before any thread takes an arena of its own (services/runtime/heap.py)
    coordinator = CoordinatorApp(config)
    # access_log off: uvicorn would format each response's access-log arguments before its first byte goes out,
    # for a logger kept at WARNING (services/observability/__init__.py); admission.py logs each generation request once
    public = DrainingServer(uvicorn.Config(coordinator.build(), host=config.server.host, port=config.server.port,
                                           log_level="warning", access_log=False,
                                           timeout_keep_alive=KEEP_ALIVE_S,
                                           timeout_graceful_shutdown=AFTER_DRAIN_S),
                            coordinator.drain)
    security = config.security
    admin = _AdminServer(uvicorn.Config(coordinator.build_admin(), host=security.admin_host, port=security.admin_port,
                                        log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    startup_done()  # what start-up built lives as long as the process: no full collection rescans it (as the roles)
    event_loop.run(_serve(public, admin, config), config.server.event_loop)
    return 0 if public.started else 1
