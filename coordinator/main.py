"""Runs the coordinator process (uvicorn on --host/--port)."""

from __future__ import annotations

import uvicorn

from services.config import EpdConfig

from .app import CoordinatorApp


def run_coordinator(config: EpdConfig) -> int:
    app = CoordinatorApp(config).build()
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=3)
    return 0
