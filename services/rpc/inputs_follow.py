"""A call opened ahead of its inputs, role side: the request says `inputs_follow_ms`, the rest comes later.

The coordinator opens the Prefill and Decode calls while the stage before them computes (docs/architecture.md,
"Calls opened ahead"), so each role has parsed its request, checked it and reserved what it can by the time
that stage answers; the answer's handles then reach it as one INPUTS frame on the same-host fast lane
(services/rpc/fastlane.py) instead of a whole new call.  gRPC has no such frame: a request that asks for one
over gRPC is refused at once (INVALID_ARGUMENT `inputs_follow_unsupported`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from services import activity
from services.protocol.errors import DeadlineExceeded, InvalidRequest

M = TypeVar("M")


def check_can_follow(context: Any, what: str) -> None:
    """Refuse at once a request whose inputs are to follow on a transport that cannot carry them."""
    if not hasattr(context, "next_input"):
        raise InvalidRequest(f"{what}.inputs_follow_ms needs the same-host fast lane; over gRPC send the whole "
                             "request", code="inputs_follow_unsupported")


async def inputs_that_follow(context: Any, follow_ms: int, message_class: type[M], what: str) -> M:
    """The call's INPUTS frame as a `message_class`, within `follow_ms`; typed errors otherwise."""
    try:
        raw = await context.next_input(follow_ms / 1000.0)
    except TimeoutError:
        raise DeadlineExceeded(f"the inputs of this {what} call did not follow within {follow_ms} ms",
                               code="inputs_timeout") from None
    activity.mark(f"{what}.inputs")
    try:
        return message_class.FromString(raw)  # type: ignore[attr-defined]
    except DecodeError:
        raise InvalidRequest(f"the inputs of this {what} call are not a {message_class.__name__}",
                             code="invalid_inputs") from None
