"""Graceful shutdown of the coordinator: on SIGTERM stop admitting, let running requests finish, then stop.

The first SIGTERM or SIGINT starts the drain: readiness (GET /ready) turns 503 at once, a new generation
request is answered 503 `shutting_down` (clients and load balancers retry elsewhere), and requests already
running, streams included, get up to `--shutdown-grace-s` to finish.  When none is left (or the grace
period is over) uvicorn stops.  A second signal stops at once.  Each step is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from .admission import GENERATION_PATHS
from .inflight import InflightRegistry

log = logging.getLogger(__name__)
POLL_S = 0.1
REPORT_EVERY_S = 2.0


class Drain:
    """Shared by the server (which starts it) and the app (which refuses work and reports it)."""

    def __init__(self, inflight: InflightRegistry, grace_s: float) -> None:
        self.inflight = inflight
        self.grace_s = grace_s
        self.requested = False
        self.draining = False

    async def run(self, stop: Callable[[], None]) -> None:
        """Wait for a request to drain (polled: signal handlers only set a flag), drain, then `stop()`."""
        while not self.requested:
            await asyncio.sleep(POLL_S)
        self.draining = True
        started = last_report = time.monotonic()
        log.info("coordinator draining: not ready, refusing new requests; %d running get up to %g s to finish",
                 len(self.inflight), self.grace_s)
        while len(self.inflight) and time.monotonic() - started < self.grace_s:
            await asyncio.sleep(POLL_S)
            if time.monotonic() - last_report >= REPORT_EVERY_S:
                log.info("coordinator draining: %d requests still running", len(self.inflight))
                last_report = time.monotonic()
        left = len(self.inflight)
        if left:
            log.warning("coordinator: grace period of %g s over, stopping with %d requests running",
                        self.grace_s, left)
        else:
            log.info("coordinator drained in %.1f s, stopping", time.monotonic() - started)
        stop()


class DrainMiddleware:
    """While draining: 503 `shutting_down` for new generation requests; everything else passes."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not (self.drain.draining and scope["type"] == "http" and scope["path"] in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "the server is shutting down: send the request to another "
                                                "replica or retry shortly", "type": "service_unavailable",
                                     "code": "shutting_down"}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains (Drain.run) instead of stopping; a second one stops."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.requested:  # a second signal: stop now
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self.drain.requested = True

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self._drainer = asyncio.create_task(self.drain.run(lambda: setattr(self, "should_exit", True)))
