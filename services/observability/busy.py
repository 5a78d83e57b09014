"""How busy a role's engine is: `epd_role_busy_fraction{role}`, the share of the last WINDOW_S its model computed.

The engines already time every forward (`compute_metrics.compute_timer`); each timed interval is also kept
here (bounded: intervals older than the window are dropped), and the gauge is computed at scrape time as the
covered share of the window, capped at 1.  It is the signal a HorizontalPodAutoscaler scales a role on
(docs/deployment.md): near 1 the role's instances compute all the time and requests queue; at the target
(0.7) its queues stay short.  Stages map to roles: encode -> encode, prefill -> prefill, decode_step -> decode.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import Gauge

WINDOW_S = 30.0
ROLE_OF_STAGE = {"encode": "encode", "prefill": "prefill", "decode_step": "decode"}
BUSY = Gauge("epd_role_busy_fraction", f"Share of the last {WINDOW_S:g} s the role's model computed (0..1): what "
             "an autoscaler scales the role on", ["role"])


class BusyWindow:
    """Compute intervals (start, end) of one role within the last `window_s`; thread-safe."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self._spans.append((start, end))
            self._drop(end)

    def _drop(self, now: float) -> None:
        while self._spans and self._spans[0][1] < now - self.window_s:
            self._spans.popleft()

    def fraction(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        since = now - self.window_s
        with self._lock:
            self._drop(now)
            covered = sum(min(end, now) - max(start, since) for start, end in self._spans if end > since)
        return min(1.0, max(0.0, covered / self.window_s))


_WINDOWS: dict[str, BusyWindow] = {}
_LOCK = threading.Lock()


def record(stage: str, start: float, end: float) -> None:
    """One timed forward of `stage` (perf_counter seconds); stages that are no role's are ignored."""
    role = ROLE_OF_STAGE.get(stage)
    if role is None:
        return
    window = _WINDOWS.get(role)
    if window is None:
        with _LOCK:
            window = _WINDOWS.get(role)
            if window is None:
                window = _WINDOWS[role] = BusyWindow()
                BUSY.labels(role).set_function(window.fraction)
    window.add(start, end)
