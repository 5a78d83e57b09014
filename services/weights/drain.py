"""Let what served replaced weights finish its requests, then free it (services/weights/role.py's `retire`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
POLL_S = 0.05


def retire_when_idle(role: str, idle: Callable[[], bool], close: Callable[[], None], limit_s: float) -> None:
    """On a thread of its own: wait until `idle()` (at most `limit_s`: the longest a request may run), then
    `close()` (which ends whatever is still running)."""
    def wait_then_close() -> None:
        deadline = time.monotonic() + limit_s
        while not idle() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if not idle():
            log.warning("%s: replaced weights still busy after %g s; closing them", role, limit_s)
        try:
            close()
        except Exception:  # noqa: BLE001 - a failing close must not kill the thread silently
            log.exception("%s: closing replaced weights failed", role)

    threading.Thread(target=wait_then_close, name=f"{role}-retire", daemon=True).start()
