"""Calls opened ahead of their inputs: a role starts on a request while the stage before it computes.

One request at a time, every hop costs a turn of the coordinator (build the request, write it) and a handler's
start in the role (parse it, check it, reserve what it needs): ~0.3 ms each on a 2-core box
(`python -m benchmarks.request_trace`).  So while render computes, the pipeline opens the Encode call, and while
encode computes, the Prefill call (its token ids, mm_metadata and sampling are known since render) and the Decode
call (sampling, prompt length), each with `inputs_follow_ms` set: prefill parses and checks its request and makes
its early inputs, decode reserves the request's KV blocks.  When a stage answers, the next step sends only what
that answer carries, as one INPUTS frame on the call already open: render's images to encode (a RenderResponse),
encode's handles to prefill (an EncodeResponse), prefill's answer to decode (its PrefillResponse).  Where the
answer before is those inputs, the coordinator's connection forwards it the moment it reads it (a `Relay`),
before any task of the coordinator wakes for it.

Where it applies: a role reached over the same-host fast lane with its connection open (FastLaneStub.open_ahead),
while the coordinator runs at most --ahead-max-inflight requests (Pipeline._ahead_pays); TLS, other hosts and
gRPC keep whole calls.  What goes wrong is handled as for a whole call: an instance that fails or refuses is
failed over from by the one failover loop (clients.with_failover, whose first attempt is the call opened ahead),
a typed error goes to the pipeline's recovery policy, and every call opened ahead that is not used (an earlier
step failed, a recovery ran, the client left) is cancelled when `prepare` ends.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.protocol.errors import EpdError
from services.rpc.fastlane import TOKEN_BYTES

from .clients import call_metadata
from .context import RequestContext
from .routing.pool import Instance, InstancePool


@dataclass
class Ahead:
    """A call opened on `instance` ahead of its inputs (its `call`: services.rpc.fastlane_client.AheadCall)."""

    pool: InstancePool
    instance: Instance
    call: Any
    used: bool = False   # its step took it (its inputs sent): the step owns it from then on
    ended: bool = False

    def take(self, inputs: Callable[[], Any]) -> Any:
        """The call (its answer or stream) is the caller's from now on; its inputs, `inputs()`, are sent unless a
        relay sent them already (the answer before it, forwarded as it arrived: services/rpc/fastlane_client.py)."""
        self.used = True
        if not self.call.sent:
            self.call.send_inputs(inputs())
        _count(self.pool, "forwarded" if self.call.forwarded else "relayed" if self.call.relayed else "used")
        return self.call

    def end(self) -> None:
        """The instance's in-flight count goes back once (answered, failed or cancelled)."""
        if not self.ended:
            self.ended = True
            self.pool.end(self.instance)

    def cancel(self) -> None:
        """Not used after all: the role's handler is cancelled, its reservation freed."""
        if not self.used:
            self.call.cancel()
            _count(self.pool, "cancelled")
        self.end()


@dataclass(frozen=True)
class Reserved:
    """The instance a later step's call opened ahead will go to, and the token its inputs will come by: the call
    before it was told (a FORWARD) to send its answer there as soon as it has one."""

    instance: Instance
    token: bytes


def reserve(pool: InstancePool, before: Any) -> Reserved | None:
    """Pick the instance of `pool` a later call opened ahead will use and tell `before` (an AheadCall, whose role
    has not started computing) to forward its answer to it: told now, the role knows it before its compute
    starts (a FORWARD sent while the role computes on its loop is read only after it answered)."""
    try:
        instance = pool.pick()
    except EpdError:
        return None
    port = getattr(instance.stub, "port", None)
    token = secrets.token_bytes(TOKEN_BYTES)
    if not isinstance(port, int) or not before.forward_to(port, token):
        return None
    return Reserved(instance, token)


def open_ahead(pool: InstancePool, ctx: RequestContext, method: str, build: Callable[[], Any],
               timeout: Callable[[], float | None], reserved: Reserved | None = None) -> Ahead | None:
    """`method` opened now on one instance with the request `build()` makes (its inputs_follow_ms set here) and
    the call timeout `timeout()` gives, or None where it cannot be (no instance, no open fast lane): the step
    then makes a whole call when its turn comes.  `reserved`: the instance and inputs token to use, while that
    instance is still healthy."""
    try:
        use = reserved if reserved is not None and reserved.instance in pool.healthy() else None
        instance = use.instance if use is not None else pool.pick()
        opener = getattr(instance.stub, "open_ahead", None)
        if opener is None:
            return None
        request = build()
        request.inputs_follow_ms = max(1, int(ctx.time_left() * 1000))
        call = opener(method, request, timeout=timeout(), metadata=call_metadata(ctx),
                      **({"token": use.token} if use is not None else {}))
    except EpdError:
        return None   # no instance now, a deadline already passed, a bad id: the whole call will say so
    if call is None:
        return None
    pool.begin(instance)
    _count(pool, "opened")
    return Ahead(pool, instance, call)


def _count(pool: InstancePool, outcome: str) -> None:
    if pool.metrics is not None:
        pool.metrics.ahead_calls.labels(pool.role, outcome).inc()
