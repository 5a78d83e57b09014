"""The generation requests running in this coordinator, so they can be cancelled and cleaned up.

The admission middleware (admission.py) opens one `InflightRequest` per
generation request, runs the endpoint in its own task and makes the record
the value of `current_request` inside it.  The pipeline `bind`s the request
id once it is known (POST /abort_requests cancels by id) and steps register
cleanups with `on_close` (an open decode stream): they run when the request
ends, however it ends (answered, failed, client gone, aborted).

Who calls what: admission.py creates and closes records; Pipeline.prepare
calls `bind`; steps call `on_close`; control_api.py calls `InflightRegistry.abort`.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

from services.edge.auth import ADMIN

log = logging.getLogger(__name__)
Cleanup = Callable[[], Awaitable[None] | None]


class InflightRequest:
    def __init__(self, registry: InflightRegistry, path: str) -> None:
        self.registry = registry
        self.path = path
        self.request_id: str | None = None      # internal, unique (request_ids.py)
        self.label: str | None = None           # the client's id: what aborts name
        self.principal = ""                     # the API key it came with (services.edge.auth.principal)
        self.task: asyncio.Task | None = None
        self.started = time.monotonic()
        self.cancel_reason: str | None = None   # "disconnect" | "abort" once cancelled
        self.on_first_token: Callable[[int | None], None] | None = None   # admission's SLO gate (slo_gate.py)
        self.on_tokens: Callable[[int], None] | None = None     # the same, per later delta (its token count)
        self._cleanups: list[Cleanup] = []

    def cancel(self, reason: str) -> bool:
        """Cancel the endpoint task (every gRPC call it awaits is cancelled with it)."""
        if self.task is None or self.task.done() or self.cancel_reason is not None:
            return False
        self.cancel_reason = reason
        self.task.cancel()
        return True

    def on_close(self, cleanup: Cleanup) -> None:
        self._cleanups.append(cleanup)

    async def close(self) -> None:
        """Run the cleanups (newest first); one failing does not stop the others."""
        while self._cleanups:
            cleanup = self._cleanups.pop()
            try:
                result = cleanup()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - cleanup is best effort; log and go on
                log.exception("request cleanup failed")


current_request: contextvars.ContextVar[InflightRequest | None] = contextvars.ContextVar(
    "current_request", default=None)


class InflightRegistry:
    def __init__(self) -> None:
        self._open: set[InflightRequest] = set()
        self._by_label: dict[str, set[InflightRequest]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, path: str) -> InflightRequest:
        record = InflightRequest(self, path)
        self._open.add(record)
        return record

    def bind(self, record: InflightRequest, request_id: str, label: str, principal: str = "") -> None:
        self._unindex(record)
        record.request_id, record.label, record.principal = request_id, label, principal
        self._by_label.setdefault(label, set()).add(record)

    def _unindex(self, record: InflightRequest) -> None:
        if record.label is not None:
            same = self._by_label.get(record.label, set())
            same.discard(record)
            if not same:
                self._by_label.pop(record.label, None)

    def discard(self, record: InflightRequest) -> None:
        self._open.discard(record)
        self._unindex(record)

    def abort(self, labels: list[str], principal: str = ADMIN) -> int:
        """Cancel the running requests with these labels (the admin's: all of them; a key's: only those it
        sent); returns how many were cancelled."""
        records = [r for label in labels for r in list(self._by_label.get(label, ()))
                   if principal == ADMIN or r.principal == principal]
        return sum(r.cancel("abort") for r in records)


def bind(request_id: str, label: str, principal: str = "") -> None:
    """Make the current request abortable by its label (no-op outside the middleware)."""
    record = current_request.get()
    if record is not None and record.request_id != request_id:
        record.registry.bind(record, request_id, label, principal)


def first_token(expected: int | None = None) -> None:
    """The current request's first token went out (the pipeline, once per request; no-op outside the middleware);
    `expected`: the tokens its answer may still send (max_tokens less one), when known."""
    record = current_request.get()
    if record is not None and record.on_first_token is not None:
        hook, record.on_first_token = record.on_first_token, None
        hook(expected)


def tokens(count: int) -> None:
    """A later delta of the current request went out with `count` tokens (no-op outside the middleware)."""
    record = current_request.get()
    if record is not None and record.on_tokens is not None:
        record.on_tokens(count)


def on_close(cleanup: Cleanup) -> bool:
    """Run `cleanup` when the current request ends; False (nothing registered) outside the middleware."""
    record = current_request.get()
    if record is None:
        return False
    record.on_close(cleanup)
    return True
