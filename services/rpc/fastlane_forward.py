"""Answers forwarded role to role on the fast lane (FORWARD, TOKEN_INPUTS: services/rpc/fastlane.py).

One request at a time, the coordinator relays three answers (render's to encode, encode's to prefill, prefill's
to decode) the moment it reads them (services/rpc/relay.py).  Each relay still costs a wake-up of the
coordinator, its read and its write on the answer's way: on a 2-vCPU box, where the role that answered keeps
running beside it, the next role often waits for a CPU as well (`python -m benchmarks.request_trace`).  Where
the coordinator knows, while a stage computes, which call opened ahead its answer feeds, it tells that stage's
role (FORWARD) and the role writes the answer straight to the next role's socket, before its answer to the
coordinator, which then only reads it.

A role holds, in its `Forwarder`:

- outgoing connections to the sockets of the roles it forwards to, one per port, opened when a FORWARD first
  names the port (the stage's compute leaves the time) and checked by the HELLO naming that port; a port
  whose socket cannot be reached is not tried again for FAILED_RETRY_S (the coordinator relays meanwhile); at
  most MAX_PEERS of them, the one named least recently closed for a new one;
- the calls of its own waiting for inputs by token (`expect`), and inputs that came before their call had
  registered (the two roles' sockets are read in either order): at most EARLY_MAX of them, EARLY_MAX_BYTES in
  all, each dropped after EARLY_TTL_S, oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import Counter

from . import fastlane as fl

log = logging.getLogger(__name__)
FORWARDED = Counter("epd_fast_lane_forwarded", "Answers this role was asked to send straight on to another role's "
                    "call (a FORWARD), by outcome: sent, or unreachable (no open connection to that role: the "
                    "coordinator relayed the answer)", ["outcome"])
FAILED_RETRY_S = 1.0
CONNECT_TIMEOUT_S = 2.0
EARLY_MAX = 64
EARLY_MAX_BYTES = 64 * 1024 * 1024
EARLY_TTL_S = 10.0
MAX_PEERS = 64    # roles this one keeps a connection to for forwarding (a cluster's prefill and decode instances)


class _Peer:
    """One outgoing connection to a role's fast-lane socket, used only to write TOKEN_INPUTS frames."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.writer: asyncio.StreamWriter | None = None
        self.failed_at = -math.inf
        self.task: asyncio.Task | None = None

    def ready(self) -> asyncio.StreamWriter | None:
        writer = self.writer
        return writer if writer is not None and not writer.is_closing() else None

    def ensure(self) -> None:
        if self.ready() is None and (self.task is None or self.task.done()) and \
                time.monotonic() - self.failed_at >= FAILED_RETRY_S:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            reader, writer = await fl.connect(self.port, CONNECT_TIMEOUT_S)
        except fl.CONNECT_ERRORS as exc:
            self.failed_at = time.monotonic()
            log.debug("no fast lane to port %d to forward to (%s)", self.port, exc)
            return
        try:
            self.writer = writer
            while await reader.read(65536):   # nothing else is sent on it: read until it closes
                pass
        except OSError as exc:
            self.failed_at = time.monotonic()
            log.debug("the fast lane to port %d closed (%s)", self.port, exc)
        finally:
            self.writer = None
            writer.close()


class Forwarder:
    def __init__(self) -> None:
        self._peers: dict[int, _Peer] = {}
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._early: OrderedDict[bytes, tuple[float, bytes]] = OrderedDict()
        self._early_bytes = 0

    # ---- this role as the one that forwards ------------------------------------------------------------

    def prepare(self, port: int) -> None:
        """A FORWARD named `port`: its connection is opened now (if not open) so the answer finds it ready.  At
        most MAX_PEERS are kept: the one named least recently goes (its connection closed) for a new one."""
        peer = self._peers.pop(port, None)
        if peer is None:
            peer = _Peer(port)
            while len(self._peers) >= MAX_PEERS:
                gone = self._peers.pop(next(iter(self._peers)))
                if gone.task is not None:
                    gone.task.cancel()
        self._peers[port] = peer   # last: the dict's order is the order ports were last named
        peer.ensure()

    def can_send(self, port: int) -> bool:
        """Whether `send` to `port` would write now (its connection is open)."""
        peer = self._peers.get(port)
        return peer is not None and peer.ready() is not None

    def send(self, port: int, token: bytes, inputs: bytes) -> bool:
        """`inputs` written to `port`'s role as the inputs of the call that named `token`; False when that role's
        connection is not open now (nothing was written: the caller answers a plain REPLY)."""
        peer = self._peers.get(port)
        writer = peer.ready() if peer is not None else None
        if writer is not None:
            try:
                writer.write(fl.frame(fl.TOKEN_INPUTS, 0, token + inputs))
            except (RuntimeError, ConnectionError):
                writer = None
        FORWARDED.labels("sent" if writer is not None else "unreachable").inc()
        return writer is not None

    # ---- this role as the one whose call gets the inputs ----------------------------------------------

    def expect(self, token: bytes, inputs: asyncio.Future) -> Callable[[], None]:
        """Inputs sent by `token` complete `inputs` (those that came already, at once); the returned function
        forgets the token (the call ended)."""
        early = self._early.pop(token, None)
        if early is not None:
            self._early_bytes -= len(early[1])
            if not inputs.done():
                inputs.set_result(early[1])
            return lambda: None
        self._waiting[token] = inputs
        return lambda: self._waiting.pop(token, None) if self._waiting.get(token) is inputs else None

    def deliver(self, token: bytes, payload: bytes) -> None:
        """A TOKEN_INPUTS frame: to the call that named the token, else kept (bounded) for one about to."""
        waiting = self._waiting.pop(token, None)
        if waiting is not None:
            if not waiting.done():
                waiting.set_result(payload)   # a second one for the same call is dropped, as for INPUTS
            return
        self._drop_early(time.monotonic())
        if len(payload) > EARLY_MAX_BYTES:
            return
        while self._early and (len(self._early) >= EARLY_MAX or self._early_bytes + len(payload) > EARLY_MAX_BYTES):
            self._early_bytes -= len(self._early.popitem(last=False)[1][1])
        self._early[token] = (time.monotonic() + EARLY_TTL_S, payload)
        self._early_bytes += len(payload)

    def _drop_early(self, now: float) -> None:
        while self._early:
            token, (expires, payload) = next(iter(self._early.items()))
            if expires > now:
                return
            del self._early[token]
            self._early_bytes -= len(payload)

    @property
    def early(self) -> int:
        """Inputs kept for a call that has not named its token yet (a gauge for tests and the curious)."""
        return len(self._early)

    async def close(self) -> None:
        for peer in self._peers.values():
            if peer.task is not None:
                peer.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await peer.task
        self._peers.clear()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.cancel()
        self._waiting.clear()
