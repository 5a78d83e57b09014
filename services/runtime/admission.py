"""A role's bounded queue: at most `limit` requests inside its core, the rest refused at once.

Refusing (Overloaded: HTTP 429 / gRPC RESOURCE_EXHAUSTED, code
`<role>_queue_full`) instead of queueing without bound keeps waits short and
memory flat under overload; the coordinator tries another instance of the
role and answers 429 with Retry-After when all are full.  The depth is
exported as `epd_role_queue_depth{role}` (running + waiting).

Used by the prefill and encode cores (serving.py); decode's engine has its
own bound (slots + queue).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from prometheus_client import Counter, Gauge

from services.protocol.errors import Overloaded

QUEUE_DEPTH = Gauge("epd_role_queue_depth", "Requests inside the role's core (running + waiting)", ["role"])
REFUSED = Counter("epd_role_refused", "Requests refused because the role's queue was full", ["role"])


class Admission:
    def __init__(self, role: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"{role} queue limit must be >= 1, got {limit}")
        self.role, self.limit = role, limit
        self.inside = 0
        self._lock = threading.Lock()
        self._depth = QUEUE_DEPTH.labels(role)
        self._depth.set(0)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        with self._lock:
            if self.inside >= self.limit:
                REFUSED.labels(self.role).inc()
                raise Overloaded(f"{self.role} is full ({self.limit} requests in progress); retry later or "
                                 "elsewhere", code=f"{self.role}_queue_full", retry_after_s=1.0)
            self.inside += 1
            self._depth.set(self.inside)
        try:
            yield
        finally:
            with self._lock:
                self.inside -= 1
                self._depth.set(self.inside)
