"""Admission, cancellation and cleanup for the generation endpoints (an ASGI middleware).

- Admission: at most `max_inflight` generation requests run at once, and none
  is started while every healthy decode instance already holds as many
  streams as it has slots plus queue; beyond that the answer is 429 with
  Retry-After at once, before any work (no pile-up, no deadline spent waiting).
  With `--ttft-slo-ms` a request that would get its first token past that target
  is refused the same way, and with `--tpot-slo-ms` one that arrives while the streams decoding are past
  that target (slo_gate.py says how it predicts).
- Cancellation: the endpoint runs in its own task.  If the client disconnects
  before the response is complete (streaming or not), or POST /abort_requests
  names the request, that task is cancelled, and with it every gRPC call it
  awaits: each role aborts its part (decode frees the slot before its next step).
- Cleanup: what steps registered with inflight.on_close runs when the request
  ends, however it ends.
- A slow reader: a response write that has waited `send_stall_s` (the stream
  idle bound) for the client to take the bytes cancels the request, so a
  client that stops reading a stream does not hold its decode slot.
- A backstop bound: a request still running `max_request_s` after it arrived
  (the pipeline enforces the request's deadlines itself) is cancelled.

Other paths pass through untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from services.observability import request_id_var
from services.protocol.errors import Aborted, DeadlineExceeded, EpdError, Overloaded

from .inflight import InflightRegistry, InflightRequest, current_request
from .metrics import CoordinatorMetrics
from .slo_gate import SloGate

log = logging.getLogger(__name__)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/inference/v1/generate"})
Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


class Exchange:
    """One HTTP exchange seen from the middleware: how far the body and the response got."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive, self._send = receive, send
        self.body_read = asyncio.Event()
        self.started = self.complete = self.disconnected = False
        self.status = 0
        self.is_sse = False
        self.sending_since: float | None = None  # a write to the client waiting since then
        self._head: dict[str, Any] | None = None   # an event stream's response start, sent with its first event
        self._stall_timer: asyncio.TimerHandle | None = None

    async def receive(self) -> dict[str, Any]:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.disconnected = True
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_read.set()
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            headers = dict(message.get("headers") or [])
            self.is_sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            # An event stream's head goes out with its first event: one write pair, one wake-up of the client
            # for both (its head alone would wake it once more before the first token).  Another start (an
            # error answer after a cancel) replaces a head not sent yet.
            self._head = message if self.is_sse else None
            if self.is_sse:
                return
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True  # before sending: the server reports a disconnect once it is sent
        self.sending_since = time.monotonic()
        try:
            if self._head is not None:
                head, self._head = self._head, None
                self.started = True
                await self._send(head)
            await self._send(message)
        finally:
            self.sending_since = None

    def watch_stall(self, record: InflightRequest, bound_s: float) -> asyncio.TimerHandle:
        """Cancel the request once one write has waited `bound_s` for the client to read: a timer that checks
        every min(1 s, bound/2) (no task: a request starts one task fewer).  Its handle, to cancel at the end."""
        loop, every = asyncio.get_running_loop(), min(1.0, bound_s / 2)

        def check() -> None:
            if self.complete:
                return
            since = self.sending_since
            if since is not None and time.monotonic() - since > bound_s:
                record.cancel("slow_reader")
                return
            self._stall_timer = loop.call_later(every, check)

        self._stall_timer = loop.call_later(every, check)
        return self._stall_timer

    def stop_watching_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()

    async def watch_disconnect(self, record: InflightRequest) -> None:
        """Once the endpoint has read the body, the only message left to come is the disconnect."""
        await self.body_read.wait()
        while not self.complete and not self.disconnected:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
        if not self.complete:
            record.cancel("disconnect")


class AdmissionMiddleware:
    def __init__(self, app: Any, registry: InflightRegistry, max_inflight: int, metrics: CoordinatorMetrics,
                 saturated: Callable[[], str | None] = lambda: None, max_request_s: float | None = None,
                 send_stall_s: float | None = None, gate: SloGate | None = None) -> None:
        self.app, self.registry, self.max_inflight = app, registry, max_inflight
        self.metrics, self.saturated, self.max_request_s = metrics, saturated, max_request_s
        self.send_stall_s, self.gate = send_stall_s, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal()
        if refusal is not None:
            await self._refuse(scope, send, refusal)
            return
        await self._run(scope, Exchange(receive, send))

    def _refusal(self) -> Overloaded | None:
        if len(self.registry) >= self.max_inflight:
            return Overloaded(f"the coordinator is running {self.max_inflight} requests, its limit; retry later",
                              code="too_many_requests", retry_after_s=1.0)
        why = self.saturated()
        if why is not None:
            return Overloaded(why, code="cluster_saturated", retry_after_s=1.0)
        return None if self.gate is None else self.gate.refusal()

    async def _refuse(self, scope: Scope, send: Send, err: Overloaded) -> None:
        self.metrics.rejected.labels(err.code).inc()
        self._count(scope["path"], err)
        await _send_error(send, err)

    async def _run(self, scope: Scope, exchange: Exchange) -> None:
        # This middleware watches for the client's disconnect itself (`watch_disconnect` cancels the endpoint),
        # so the app is told ASGI 2.4's contract: Starlette then streams a response without a second disconnect
        # listener and the task group it needs (uvicorn says 2.3; what 2.4 adds is send raising on a gone client,
        # and a gone client's stream is cancelled here instead).
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}
        record = self.registry.open(scope["path"])
        self.metrics.inflight.set(len(self.registry))
        if self.gate is not None:
            self.gate.admitted(id(record))
            record.on_first_token = lambda expected, gate=self.gate: gate.first_token(id(record), expected)
            record.on_tokens = lambda count, gate=self.gate: gate.tokens(id(record), count)
        token = current_request.set(record)  # the endpoint task copies this context
        try:
            record.task = asyncio.create_task(self.app(scope, exchange.receive, exchange.send))
            watcher = asyncio.create_task(exchange.watch_disconnect(record))
            if self.send_stall_s is not None:
                exchange.watch_stall(record, self.send_stall_s)
            timer = None if self.max_request_s is None else \
                asyncio.get_running_loop().call_later(self.max_request_s, record.cancel, "deadline")
            try:
                await asyncio.shield(record.task)
            except asyncio.CancelledError:
                if not record.task.cancelled():
                    record.task.cancel()  # this task itself is cancelled (server shutdown): take the endpoint along
                    raise
                await self._after_cancel(scope, exchange, record)
            finally:
                watcher.cancel()
                exchange.stop_watching_stall()
                if timer is not None:
                    timer.cancel()
        finally:
            current_request.reset(token)
            if self.gate is not None:
                self.gate.ended(id(record))
            await record.close()
            self.registry.discard(record)
            self.metrics.inflight.set(len(self.registry))
            self._log(scope, exchange, record)

    async def _after_cancel(self, scope: Scope, exchange: Exchange, record: InflightRequest) -> None:
        reason = record.cancel_reason or "cancelled"
        self.metrics.cancelled.labels(reason).inc()
        if exchange.disconnected or exchange.complete:
            self.metrics.requests.labels(scope["path"], "499").inc()
            return  # nobody is listening any more
        err = _cancel_error(reason, record.label)
        self._count(scope["path"], err)
        if reason in ("deadline", "slow_reader") and exchange.started:
            return  # the client stopped reading: sending more would block again; the server closes it
        if not exchange.started:
            await _send_error(exchange.send, err)
        else:  # a stream already running: end it with an in-stream error, as any late failure
            tail = f"data: {json.dumps(err.to_body())}\n\ndata: [DONE]\n\n" if exchange.is_sse else ""
            await exchange.send({"type": "http.response.body", "body": tail.encode(), "more_body": False})

    def _count(self, path: str, err: EpdError) -> None:
        self.metrics.requests.labels(path, str(err.status)).inc()
        self.metrics.errors.labels(path, err.code).inc()

    @staticmethod
    def _log(scope: Scope, exchange: Exchange, record: InflightRequest) -> None:
        token = request_id_var.set(record.request_id or "-")
        status = "client gone" if exchange.disconnected and not exchange.complete else exchange.status
        log.info("%s %s -> %s in %.3f s", scope["method"], scope["path"], status, time.monotonic() - record.started)
        request_id_var.reset(token)


def _cancel_error(reason: str, request_id: str | None) -> EpdError:
    name = f"request {request_id}" if request_id else "the request"
    if reason == "deadline":
        return DeadlineExceeded(f"{name} ran past its deadline", code="deadline_exceeded")
    return Aborted(f"{name} was aborted", code="aborted")


async def _send_error(send: Send, err: EpdError) -> None:
    body = json.dumps(err.to_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.retry_after_s:
        headers.append((b"retry-after", str(max(1, round(err.retry_after_s))).encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
