"""gRPC calls to role pools with deadlines, passive health and failover.

A call carries what is left of the request's deadline and the request id
(metadata `x-request-id`).  Transport failures (UNAVAILABLE, a broken
connection) mark the instance down and retry once per other healthy instance;
errors the role raised on purpose (bad input, missing entry) are rebuilt as
the same typed error and not retried.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from services.protocol.errors import ERROR_CODE_METADATA_KEY, EpdError, from_grpc

from .context import RequestContext
from .routing.pool import Instance, InstancePool

log = logging.getLogger(__name__)
TRANSPORT_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def error_from_rpc(exc: grpc.aio.AioRpcError) -> EpdError:
    epd_code = None
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_CODE_METADATA_KEY:
            epd_code = value if isinstance(value, str) else value.decode()
    return from_grpc(exc.code(), exc.details(), epd_code)


def is_transport_failure(exc: grpc.aio.AioRpcError) -> bool:
    """The instance (not the request) failed: no epd error code came back."""
    if exc.code() not in TRANSPORT_FAILURES:
        return False
    return not any(k == ERROR_CODE_METADATA_KEY for k, _ in exc.trailing_metadata() or ())


def call_metadata(ctx: RequestContext) -> list[tuple[str, str]]:
    return [("x-request-id", ctx.request_id)]


async def call_unary(pool: InstancePool, ctx: RequestContext, method: str, request: Any,
                     key: str | None = None) -> tuple[Any, Instance]:
    """Call `method` on one instance of the pool, failing over on transport failures."""
    tried: set[str] = set()
    while True:
        instance = pool.pick(key, exclude=tried)
        tried.add(instance.address)
        try:
            with pool.track(instance):
                reply = await getattr(instance.stub, method)(
                    request, timeout=ctx.time_left(), metadata=call_metadata(ctx))
            return reply, instance
        except grpc.aio.AioRpcError as exc:
            if not is_transport_failure(exc):
                raise error_from_rpc(exc) from None
            pool.mark_down(instance, f"{method}: {exc.code().name}")
            log.warning("%s call to %s failed (%s); failing over", method, instance.address, exc.code().name)
            ctx.extra["failovers"] = ctx.extra.get("failovers", 0) + 1
