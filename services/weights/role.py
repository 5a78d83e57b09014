"""One role process's weights: the version it serves, a version staged beside it, and the switch between them.

The coordinator drives a weight update (coordinator/weights.py) through each encode, prefill and decode
instance's WeightsService:

- `stage(version, path)`: check the checkpoint (services/weights/checkpoint.py), then build everything the
  role serves with (model, kernels, engine) from it in a thread, beside what serves now, which keeps serving;
- `commit(version)`: serve the staged build from now on; the build it replaces is handed to its `retire`,
  which lets the requests already inside it finish before its engine closes (old weights kept until they
  drain);
- `discard(version)`: drop a staged build (an update that failed on another instance).

Every request names the version it runs on (`weight_version` on the gRPC calls; "" from a direct HTTP caller
means "whatever is served"); `check` refuses another (Conflict `weight_version_mismatch`), and the answer
names the version that ran it.  "base" is the weights of the role's own --model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.protocol.errors import Conflict, InvalidRequest

from .checkpoint import check_checkpoint

log = logging.getLogger(__name__)
BASE_VERSION = "base"
RETIRE_POLL_S = 0.05


@dataclass
class Staged:
    version: str
    path: str
    built: Any
    seconds: float


class RoleWeights:
    """`build(folder, version)` makes what the role serves with (in a thread); `swap(built)` makes it served and
    returns what it replaced; `retire(old)` lets the replaced one drain, then frees it."""

    def __init__(self, role: str, base: Path, build: Callable[[Path, str], Any], swap: Callable[[Any], Any],
                 retire: Callable[[Any], None]) -> None:
        self.role, self.base = role, base
        self._build, self._swap, self._retire = build, swap, retire
        self.version, self.path = BASE_VERSION, ""
        self.staged: Staged | None = None
        self.stage_s = self.commit_s = 0.0
        self._lock = asyncio.Lock()   # one stage or commit at a time

    def check(self, version: str) -> str:
        """The version a request runs on: the served one, which it must name (or leave empty)."""
        if version and version != self.version:
            raise Conflict(f"this {self.role} instance serves weight version {self.version!r}, the request runs "
                           f"on {version!r}", code="weight_version_mismatch")
        return self.version

    async def stage(self, version: str, path: str) -> None:
        if not version:
            raise InvalidRequest("a weight version must be named", code="invalid_weight_version")
        async with self._lock:
            if self.staged is not None and self.staged.version == version and self.staged.path == path:
                return   # staged already (a retried call)
            folder = check_checkpoint(path, self.base) if path else self.base
            started = time.monotonic()
            built = await asyncio.to_thread(self._build, folder, version)
            self._drop_staged()
            self.staged = Staged(version, path, built, time.monotonic() - started)
            self.stage_s = self.staged.seconds
            log.info("%s: weights %r staged from %s in %.1f s", self.role, version, folder, self.stage_s)

    async def commit(self, version: str) -> None:
        async with self._lock:
            if self.version == version and self.staged is None:
                return   # committed already (a retried call)
            if self.staged is None or self.staged.version != version:
                raise Conflict(f"this {self.role} instance has no weights {version!r} staged "
                               f"(staged: {self.staged.version if self.staged else None!r})",
                               code="weight_version_not_staged")
            started = time.monotonic()
            staged, self.staged = self.staged, None
            old = self._swap(staged.built)    # on the event loop: a request sees the old or the new, whole
            self.version, self.path = staged.version, staged.path
            self._retire(old)
            self.commit_s = time.monotonic() - started
            log.info("%s: now serving weights %r (switch %.3f s)", self.role, version, self.commit_s)

    async def discard(self, version: str) -> None:
        async with self._lock:
            if self.staged is not None and self.staged.version == version:
                self._drop_staged()

    def _drop_staged(self) -> None:
        staged, self.staged = self.staged, None
        if staged is not None:
            self._retire(staged.built)

    def info(self) -> dict[str, Any]:
        return {"weight_version": self.version, "path": self.path,
                "staged_version": self.staged.version if self.staged else "",
                "stage_s": self.stage_s, "commit_s": self.commit_s}


def retire_when_idle(role: str, idle: Callable[[], bool], close: Callable[[], None], limit_s: float) -> None:
    """A `retire` for RoleWeights: on a thread of its own, wait until `idle()` (at most `limit_s`: the longest a
    request may run), then `close()` (which ends whatever is still running)."""
    def wait_then_close() -> None:
        deadline = time.monotonic() + limit_s
        while not idle() and time.monotonic() < deadline:
            time.sleep(RETIRE_POLL_S)
        if not idle():
            log.warning("%s: replaced weights still busy after %g s; closing them", role, limit_s)
        try:
            close()
        except Exception:  # noqa: BLE001 - a failing close must not kill the thread silently
            log.exception("%s: closing replaced weights failed", role)

    threading.Thread(target=wait_then_close, name=f"{role}-retire", daemon=True).start()
