"""Shared plumbing of every gRPC servicer: request ids, error mapping, metrics and one log line per call.

`rpc_method` wraps a servicer coroutine: it sets the request-id contextvar
from the `x-request-id` metadata, and turns an EpdError into the matching
gRPC status with the epd error code in trailing metadata (so the coordinator
rebuilds the same typed error).  Any other exception becomes INTERNAL
without leaking its text.  `rpc_stream` does the same for server streams.

Every call is counted in `epd_rpc_requests{method, code}` (code "ok", the epd
error code, or "cancelled" when the caller went away) and timed in
`epd_rpc_seconds{method}`, and ends with one log line carrying the request id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter, Histogram

from services import activity
from services.observability import request_id_var
from services.protocol.errors import ERROR_CODE_METADATA_KEY, EpdError, as_epd_error

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_MESSAGE_CHARS = 2000
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
RPC_REQUESTS = Counter("epd_rpc_requests", "gRPC calls served, by method and result code", ["method", "code"])
RPC_SECONDS = Histogram("epd_rpc_seconds", "gRPC call duration (stage time inside this role)", ["method"],
                        buckets=_BUCKETS)


def _bind_request_id(context: grpc.aio.ServicerContext, fallback: str = "-") -> None:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            request_id_var.set(value)
            return
    request_id_var.set(fallback)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    err = as_epd_error(exc)
    if not isinstance(exc, EpdError):
        log.exception("unhandled error in servicer")
    context.set_trailing_metadata(((ERROR_CODE_METADATA_KEY, err.code),))
    # The status message travels as metadata (8 KiB limit): a message quoting a huge input would be
    # replaced by a transport error, so it is cut (the caller sent the input; it needs no full echo).
    message = err.message if len(err.message) <= MAX_MESSAGE_CHARS else err.message[:MAX_MESSAGE_CHARS] + "..."
    await context.abort(err.grpc_code, message)


def _done(method: str, started: float, code: str) -> None:
    """The call's time, taken now; its counters and log line once the answer is on its way: recorded on the loop's
    next turn (the server writes the answer first, and the next role or the coordinator wakes for it before the
    bookkeeping runs), in this call's context (its request id)."""
    elapsed = time.monotonic() - started
    try:
        asyncio.get_running_loop().call_soon(_record, method, code, elapsed)
    except RuntimeError:   # no loop running (a servicer called directly): recorded at once
        _record(method, code, elapsed)


def _record(method: str, code: str, elapsed: float) -> None:
    RPC_REQUESTS.labels(method, code).inc()
    RPC_SECONDS.labels(method).observe(elapsed)
    level = logging.INFO if code in ("ok", "cancelled") else logging.WARNING
    log.log(level, "%s %s in %.1f ms", method, code, elapsed * 1000)


def rpc_method(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    entered, left = f"{fn.__name__}.in", f"{fn.__name__}.out"  # the activity marks' names, built once

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        _bind_request_id(context, getattr(request, "request_id", "-"))
        started, code = time.monotonic(), "ok"
        activity.mark(entered)
        try:
            answer = await fn(self, request, context)
            activity.mark(left)
            return answer
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            code = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            code = as_epd_error(exc).code
            await _abort(context, exc)
            raise  # unreachable: abort raises
        finally:
            _done(fn.__name__, started, code)

    return wrapper


def rpc_stream(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    entered, first_item = f"{fn.__name__}.in", f"{fn.__name__}.first"

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        _bind_request_id(context, getattr(request, "request_id", "-"))
        started, code = time.monotonic(), "ok"
        activity.mark(entered)
        first = True
        try:
            async for item in fn(self, request, context):
                if first:
                    activity.mark(first_item)
                    first = False
                yield item
        except grpc.aio.AbortError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            code = as_epd_error(exc).code
            await _abort(context, exc)
        finally:
            _done(fn.__name__, started, code)

    return wrapper
