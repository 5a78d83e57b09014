"""gRPC calls to role pools with deadlines, passive health and failover.

A call carries what is left of the request's deadline and the request id
(metadata `x-request-id`).  Transport failures (UNAVAILABLE, a broken
connection: no epd error code came back) mark the instance down and retry on
another healthy instance; an instance that answers Overloaded (its bounded
queue is full) is skipped for this call without being marked down, and if
every instance refused, the Overloaded error (429) is what the caller gets.
Other errors the role raised on purpose (bad input, missing entry) are
rebuilt as the same typed error and not retried here (the pipeline's
recovery policy decides what a missing entry means).  `with_failover` is
the one loop; unary calls and the decode stream's opening both use it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from services.protocol.errors import (
    ERROR_CODE_METADATA_KEY,
    EpdError,
    InternalError,
    InvalidRequest,
    Overloaded,
    Unavailable,
    from_grpc,
)

from .context import RequestContext
from .routing.pool import Instance, InstancePool

if TYPE_CHECKING:
    from .ahead import Ahead

log = logging.getLogger(__name__)
T = TypeVar("T")
TRANSPORT_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def error_from_rpc(exc: grpc.aio.AioRpcError) -> EpdError:
    epd_code = None
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_CODE_METADATA_KEY:
            epd_code = value if isinstance(value, str) else value.decode()
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and epd_code is None:
        # grpc's own limits (message or metadata size), not a role saying it is full: no 429.
        return InternalError(f"gRPC limit exceeded: {exc.details()}", code="grpc_limit_exceeded")
    return from_grpc(exc.code(), exc.details(), epd_code)


def is_transport_failure(exc: grpc.aio.AioRpcError) -> bool:
    """The instance (not the request) failed: no epd error code came back."""
    if exc.code() not in TRANSPORT_FAILURES:
        return False
    return not any(k == ERROR_CODE_METADATA_KEY for k, _ in exc.trailing_metadata() or ())


_METADATA_SAFE = re.compile(r"[\x20-\x7e]{1,300}")  # a label (<= 256) plus the internal suffix


def call_metadata(ctx: RequestContext) -> list[tuple[str, str]]:
    """The request id travels as gRPC metadata, which takes printable ASCII only (and little of it)."""
    if not _METADATA_SAFE.fullmatch(ctx.request_id):
        raise InvalidRequest("request id (X-Request-Id or request_id) must be 1-256 printable ASCII characters",
                             code="invalid_request_id")
    return [("x-request-id", ctx.request_id)]


def count_call(pool: InstancePool, instance: Instance, result: str) -> None:
    if pool.metrics is not None:
        pool.metrics.instance_calls.labels(pool.role, instance.address, result).inc()


def on_transport_failure(pool: InstancePool, instance: Instance, ctx: RequestContext, what: str) -> None:
    """Count the failure against the request's retry budget, then fail over.

    The first instance a request makes fail is taken out at once (a dead instance must not get more
    work).  Once the request has made one fail, later failures are as likely the request's doing (a
    poison request crashing every instance in turn): those instances stay in (their health probe takes
    out one that really died), and past --max-retries the request is refused, not retried.
    """
    suspect = bool(ctx.failed_on)
    ctx.failed_on.append(instance.address)
    count_call(pool, instance, "failed")
    if not suspect:
        pool.mark_down(instance, what)
    if len(ctx.failed_on) > ctx.max_retries:
        if pool.metrics is not None:
            pool.metrics.retries.labels(pool.role, "budget_exhausted").inc()
        err = Unavailable(f"request {ctx.label} failed at the transport level on {len(ctx.failed_on)} instances "
                          f"({', '.join(ctx.failed_on)}); it is not retried further (--max-retries "
                          f"{ctx.max_retries}): the request itself is the likely cause", code="retry_budget_exhausted")
        log.warning("%s", err.message)
        raise err
    log.warning("%s on %s failed (%s); failing over%s", what.split(":")[0], instance.address, what,
                " (not marked down: this request already made an instance fail)" if suspect else "")
    ctx.failovers += 1
    if pool.metrics is not None:
        pool.metrics.failovers.labels(pool.role).inc()


def on_refusal(pool: InstancePool, instance: Instance) -> None:
    count_call(pool, instance, "refused")
    if pool.metrics is not None:
        pool.metrics.retries.labels(pool.role, "overloaded").inc()


def pick_next(pool: InstancePool, key: str | None, tried: set[str], refused: Overloaded | None) -> Instance:
    """The next instance to try; when none is left and some refused for load, the answer is a 429."""
    try:
        return pool.pick(key, exclude=tried)
    except Unavailable:
        if refused is not None:
            raise Overloaded(f"every {pool.role} instance is busy: {refused.message}", code=refused.code,
                             retry_after_s=1.0) from None
        raise


async def with_failover(pool: InstancePool, ctx: RequestContext, what: str,
                        attempt: Callable[[Instance], Awaitable[T]], key: str | None = None,
                        first: Instance | None = None) -> tuple[T, Instance]:
    """The one failover loop: run `attempt` on one instance after another until one answers.

    `attempt` raises grpc.aio.AioRpcError for a failed call; a transport failure marks the instance
    down and tries the next, a refusal (Overloaded) tries the next without marking it down, any other
    error is the request's own and is raised as the typed error the role sent.  `first`: the instance
    to try first (a call opened ahead of its inputs is there: coordinator/ahead.py).
    """
    tried: set[str] = set()
    refused: Overloaded | None = None
    while True:
        instance = first if first is not None and not tried else pick_next(pool, key, tried, refused)
        tried.add(instance.address)
        try:
            result = await attempt(instance)
        except grpc.aio.AioRpcError as exc:
            if is_transport_failure(exc):
                on_transport_failure(pool, instance, ctx, f"{what}: {exc.code().name}")
                continue
            err = error_from_rpc(exc)
            if not isinstance(err, Overloaded):
                raise err from None
            on_refusal(pool, instance)
            refused = err
            continue
        count_call(pool, instance, "ok")
        return result, instance


async def call_unary(pool: InstancePool, ctx: RequestContext, method: str, request: Any | Callable[[], Any],
                     key: str | None = None, ahead: Ahead | None = None, inputs: Callable[[], Any] | None = None,
                     relay: Any = None) -> tuple[Any, Instance]:
    """Call `method` on one instance of the pool, failing over on transport failures and refusals.  With
    `ahead` (the call opened ahead of its inputs), the first attempt sends it `inputs()`; `request` (or the
    function that builds it) is the whole call any other attempt makes.  `relay`: where a fast-lane call's
    answer goes on to as it arrives (services.rpc.fastlane_client.Relay)."""
    async def attempt(instance: Instance) -> Any:
        if ahead is not None and not ahead.used and instance is ahead.instance:
            assert inputs is not None
            try:
                return await ahead.take(inputs).answer()
            finally:
                ahead.end()
        whole = request() if callable(request) else request
        extra = {"relay": relay} if relay is not None and hasattr(instance.stub, "open_ahead") else {}
        with pool.track(instance):
            return await getattr(instance.stub, method)(whole, timeout=ctx.time_left(), metadata=call_metadata(ctx),
                                                        **extra)

    return await with_failover(pool, ctx, method, attempt, key, ahead.instance if ahead is not None else None)
