"""The event loop every epd process runs on (`--event-loop`): uvloop by default, or the standard library's.

Why uvloop: one request at a time, most of what is not model compute is event-loop work (socket reads and
writes, callbacks, task steps) in five processes; uvloop's libuv loop does that work in C.
`python -m benchmarks.overhead --compare-ref` measured the default against `--event-loop asyncio` (see
docs/benchmarks.md).  The roles' gRPC servers and the coordinator's gRPC channels (grpc.aio) run on either.

One difference the code relies on being handled: libuv's poll handle makes a watched file descriptor
non-blocking (`loop.add_reader`); services/render/image_procs.py sets its worker sockets back to blocking.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from prometheus_client import Gauge

from services.config import EVENT_LOOPS

T = TypeVar("T")
LOOPS = EVENT_LOOPS   # defined once, with the setting (services/config)
INFO = Gauge("epd_event_loop_info", "The event loop this process runs on (1 = in use; --event-loop)", ["loop"])


def run(main: Coroutine[Any, Any, T], kind: str = "uvloop") -> T:
    """`asyncio.run(main)` on the loop `kind` names; `epd_event_loop_info` says which one runs."""
    if kind not in LOOPS:
        main.close()
        raise ValueError(f"event loop must be one of {', '.join(LOOPS)}, not {kind!r}")

    async def reported() -> T:
        INFO.labels(running_kind()).set(1)
        return await main

    if kind == "uvloop":
        import uvloop

        return uvloop.run(reported())
    return asyncio.run(reported())


def running_kind() -> str:
    """Which loop the calling coroutine runs on (the config report and the tests read it)."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
