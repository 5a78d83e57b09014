"""Shared plumbing of every gRPC servicer: request ids and error mapping.

`rpc_method` wraps a servicer coroutine: it sets the request-id contextvar
from the `x-request-id` metadata, and turns an EpdError into the matching
gRPC status with the epd error code in trailing metadata (so the coordinator
rebuilds the same typed error).  Any other exception becomes INTERNAL
without leaking its text.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from services.observability import request_id_var
from services.protocol.errors import ERROR_CODE_METADATA_KEY, EpdError, as_epd_error

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    await context.abort(err.grpc_code, err.message)


def rpc_method(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        _bind_request_id(context, getattr(request, "request_id", "-"))
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            await _abort(context, exc)
            raise  # unreachable: abort raises

    return wrapper


def rpc_stream(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        _bind_request_id(context, getattr(request, "request_id", "-"))
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            await _abort(context, exc)

    return wrapper
