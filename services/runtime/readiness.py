"""Readiness of one role process: it can serve now, not merely run (that is liveness, GET /health).

A role is ready when its core says so (`RoleServer.is_ready`), every tensor store it uses answers (the
Redis of a redis store replies to PING; a producer's shm pool is still mapped under /dev/shm) and it is
not draining for shutdown.  At start it is not ready until a check passes; once ready, a problem must last
NOT_READY_AFTER_S before it turns readiness false (a Redis restart of a second fails only the calls that
meet it, with their own clear errors), and one passing check makes it ready again.
`Readiness.run` re-checks every CHECK_INTERVAL_S and mirrors the answer into
the standard gRPC health status (SERVING / NOT_SERVING), which is what the coordinator probes: a role
that is not ready takes no work, and the coordinator is not ready while a role has no ready instance.
GET /ready answers 200 or 503 with the problems, each naming what is wrong.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
CHECK_INTERVAL_S = 0.5
CHECK_TIMEOUT_S = 2.0
REDIS_PING_S = 0.5   # a Redis that does not answer a PING in this long (no retry) is not reachable
NOT_READY_AFTER_S = 2.0
SHM_DIR = "/dev/shm"


def redis_where(url: str) -> str:
    """host:port/db of a Redis URL, never its password."""
    return str(url).split("://", 1)[-1].rsplit("@", 1)[-1]


class StoreCheck:
    """Checks one tensor store; for Redis with its own small connection (never the store's busy ones)."""

    def __init__(self, store: Any) -> None:
        self.config = store.config
        self.segment = getattr(store, "segment", None)
        self._client: Any = None

    @property
    def label(self) -> str:
        return f"{self.config.purpose} store ({self.config.backend})"

    def problem(self, seen: dict[str, str | None] | None = None) -> str | None:
        """What is wrong with the store, or None; `seen` holds this round's answers per Redis URL (a role's stores
        share one Redis: it is asked once)."""
        if self.config.backend == "redis":
            seen = {} if seen is None else seen
            if self.config.redis_url not in seen:
                seen[self.config.redis_url] = self._redis_problem()
            reason = seen[self.config.redis_url]
            return None if reason is None else f"{self.label}: {reason}"
        if self.config.backend == "shm":
            return self._shm_problem()
        return None

    def _redis_problem(self) -> str | None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from services.connectors.redis_nodes import is_cluster, ping_problem

        where = redis_where(self.config.redis_url)
        if is_cluster(self.config.redis_url):   # usable while any node answers: a lost node's entries are misses
            problem = ping_problem(self.config.redis_url, REDIS_PING_S)
            return None if problem is None else f"no node of the Redis Cluster at {where} is reachable ({problem})"
        try:
            if self._client is None:
                self._client = redis.Redis.from_url(self.config.redis_url, socket_connect_timeout=REDIS_PING_S,
                                                    socket_timeout=REDIS_PING_S, retry=Retry(NoBackoff(), 0))
            self._client.ping()
        except (redis.RedisError, OSError) as exc:
            return f"Redis at {where} is not reachable ({str(exc).splitlines()[0][:100]})"
        return None

    def _shm_problem(self) -> str | None:
        if not self.config.preallocate:  # a consumer maps others' pools by handle: /dev/shm must be there
            return None if os.path.isdir(SHM_DIR) else f"{self.label}: {SHM_DIR} is missing"
        if self.segment and not os.path.exists(os.path.join(SHM_DIR, self.segment)):
            return f"{self.label}: its pool {self.segment} is no longer in {SHM_DIR}"
        return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class Readiness:
    def __init__(self, role_name: str, is_ready: Callable[[], bool], stores: list[Any]) -> None:
        self.role_name = role_name
        self._core_ready = is_ready
        self.checks = [StoreCheck(s) for s in stores]
        self.problems: list[str] = ["not checked yet"]
        self.draining = False
        self._failing_since: float | None = None
        self._running: asyncio.Future | None = None   # the check in its thread, when one outlived its deadline

    @property
    def ready(self) -> bool:
        return not self.draining and not self.problems

    def reasons(self) -> list[str]:
        return (["draining for shutdown"] if self.draining else []) + self.problems

    def _check(self) -> list[str]:
        problems = [] if self._core_ready() else [f"{self.role_name} is still starting"]
        seen: dict[str, str | None] = {}
        return problems + [p for c in self.checks if (p := c.problem(seen)) is not None]

    async def refresh(self) -> bool:
        """Check now (in a thread: a Redis PING must not stall the event loop); True when ready."""
        # One check at a time: a check stuck on an unreachable host is waited for, not joined by one more
        # thread every interval (they would fill the loop's default executor, which the role's work needs).
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(asyncio.to_thread(self._check))
        try:
            problems = await asyncio.wait_for(asyncio.shield(self._running), CHECK_TIMEOUT_S)
        except TimeoutError:
            problems = [f"the readiness checks took over {CHECK_TIMEOUT_S:g} s"]
        now = time.monotonic()
        if not problems:
            self._failing_since = None
        elif self._failing_since is None:
            self._failing_since = now
        if problems and not self.problems and now - (self._failing_since or now) < NOT_READY_AFTER_S:
            return self.ready  # a blip: stay ready unless it lasts
        if problems != self.problems:
            if problems:
                log.warning("%s not ready: %s", self.role_name, "; ".join(problems))
            else:
                log.info("%s ready", self.role_name)
        self.problems = problems
        return self.ready

    async def run(self, on_change: Callable[[bool], Any]) -> None:
        """Re-check for ever; `on_change(ready)` whenever the answer flips (and once at the start)."""
        last: bool | None = None
        while True:
            ready = await self.refresh()
            if ready != last:
                result = on_change(ready)
                if asyncio.iscoroutine(result):
                    await result
                last = ready
            await asyncio.sleep(CHECK_INTERVAL_S)

    def body(self) -> dict[str, Any]:
        return {"status": "ready" if self.ready else "not_ready", "role": self.role_name,
                "problems": self.reasons()}

    def close(self) -> None:
        for check in self.checks:
            check.close()
