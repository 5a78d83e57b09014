"""Runs the coordinator process: uvicorn on --host/--port, draining on SIGTERM (coordinator.drain)."""

from __future__ import annotations

import uvicorn

from services.config import EpdConfig

from .app import CoordinatorApp
from .drain import DrainingServer

AFTER_DRAIN_S = 2.0  # uvicorn's own wait for connections once the drain is over (idle keep-alives)


def run_coordinator(config: EpdConfig) -> int:
    coordinator = CoordinatorApp(config)
    server = DrainingServer(uvicorn.Config(coordinator.build(), host=config.host, port=config.port,
                                           log_level="warning", timeout_graceful_shutdown=AFTER_DRAIN_S),
                            coordinator.drain)
    server.run()
    return 0 if server.started else 1
