"""Where a unary call's answer goes on to: the coordinator's side of relays and forwards (services/rpc/fastlane.py).

A `Relay` belongs to one unary fast-lane call (its source) and names a call opened ahead (its target) whose
inputs that answer is.  The answer goes on in one of two ways:

- forwarded, role to role: once the relay knows both its source call and its target, and the answer needs no
  shaping, the coordinator sends the source's role a FORWARD naming the target's role (its gRPC port) and the
  target call's token.  The source role writes its answer to the target role's socket itself, before its
  answer to the coordinator, which arrives as REPLY_FORWARDED (`forwarded()`): the coordinator's wake-up, read
  and write are off the request's path.  services/rpc/fastlane_forward.py is the role's side.
- relayed, by the coordinator: otherwise (a FORWARD that came too late, a role that could not reach the target,
  an answer to shape), the coordinator's connection reader writes the answer on the moment it reads it (the
  relay is called with the answer), before any coordinator task wakes for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import fastlane as fl

if TYPE_CHECKING:
    from .fastlane_client import AheadCall, _Connection

log = logging.getLogger(__name__)


class Relay:
    """Where a unary call's answer goes on to, the moment it is ready: `target`, a call opened ahead, gets the
    answer's bytes (with `suffix` appended: protobuf merges two messages' repeated fields) as its inputs.  No
    target (yet), an error answer or a target already fed: nothing is sent.  `about`: what the answer is for (the
    images an encode call encodes), for whoever sets the target.  `shape`, when set, turns the answer into the
    inputs to send (None: send nothing; the step then sends what it decides); a shaped answer is never
    forwarded (the role would send it as it is)."""

    def __init__(self, about: Any = None, target: AheadCall | None = None, suffix: bytes = b"") -> None:
        self.about, self.target, self.suffix = about, target, suffix
        self.shape: Callable[[bytes], bytes | None] | None = None
        self._source: tuple[_Connection, int] | None = None   # the connection and call whose answer this is
        self.forward_sent = False

    def attach(self, connection: _Connection, call_id: int) -> None:
        """The fast-lane call whose answer this relays (FastLaneStub calls, AheadCall.relay_answer)."""
        self._source = (connection, call_id)
        self._forward()

    def aim(self, target: AheadCall, suffix: bytes = b"") -> None:
        """The answer goes on to `target`, with `suffix`: forwarded by the role where it can be, else relayed."""
        self.target, self.suffix = target, suffix
        self._forward()

    def _forward(self) -> None:
        target, source = self.target, self._source
        if source is None or target is None or target.token is None or target.port is None or \
                self.shape is not None or self.forward_sent or target.sent:
            return
        connection, call_id = source
        if connection.relays.get(call_id) is not self:
            return   # answered already (relayed as it was read)
        if connection.forwarded_to.get(call_id) == target.token and not self.suffix:
            self.forward_sent = True   # the role was told already (a call reserved for this target ahead)
            return
        self.forward_sent = connection.forward(call_id, target.port, target.token, self.suffix)

    def forwarded(self) -> None:
        """The source role sent the answer on itself (REPLY_FORWARDED): the target has its inputs."""
        if self.target is not None:
            self.target.sent = self.target.relayed = self.target.forwarded = True

    def __call__(self, kind: int | None, payload: bytes) -> None:
        if kind != fl.REPLY or self.target is None or self.target.sent:
            return
        inputs = payload if self.shape is None else self.shape(payload)
        if inputs is not None:
            self.target.send_raw(inputs + self.suffix)
            self.target.relayed = True


def relay_answer(relay: Relay, kind: int | None, payload: bytes) -> None:
    """A relay that fails (its target's connection going away, an answer it cannot shape) only loses the shortcut:
    the step sends the inputs itself; this connection and its calls carry on."""
    try:
        relay(kind, payload)
    except Exception:  # noqa: BLE001 - the shortcut is optional, the connection is not
        log.exception("relaying an answer on failed; the step sends the inputs itself")
