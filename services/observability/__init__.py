"""Logging with the request id in every line, and the Prometheus registry.

The request id lives in a contextvar set by each transport when a call
arrives (from X-Request-Id or the message's request_id), so every log line
of that request, in every stage, carries it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str, instance_id: str) -> None:
        super().__init__()
        self.role, self.instance_id = role, instance_id

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(time.time(), 3), "level": record.levelname.lower(), "role": self.role,
            "instance": self.instance_id, "request_id": request_id_var.get(), "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(role: str, instance_id: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(role, instance_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
