"""The typed role clients: each role's instances behind the calls the steps make, with deadlines, passive health
and failover.

Steps talk to `RenderClient`, `EncodeClient`, `PrefillClient` (here) and `DecodeClient` (decode_stream.py),
never to a transport: an instance's stub is gRPC over TCP, or the same methods over the same-host fast lane
(services/rpc/fastlane_client.py), and both fail the same way (grpc.aio.AioRpcError with the role's epd
error code in the trailing metadata).

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
from typing import Any, TypeVar

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
from services.rpc.v1 import epd_pb2 as pb

from .context import RequestContext
from .routing.pool import Instance, InstancePool

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
                        attempt: Callable[[Instance], Awaitable[T]], key: str | None = None) -> tuple[T, Instance]:
    """The one failover loop: run `attempt` on one instance after another until one answers.

    `attempt` raises grpc.aio.AioRpcError for a failed call; a transport failure marks the instance
    down and tries the next, a refusal (Overloaded) tries the next without marking it down, any other
    error is the request's own and is raised as the typed error the role sent.
    """
    tried: set[str] = set()
    refused: Overloaded | None = None
    while True:
        instance = pick_next(pool, key, tried, refused)
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


class RoleClient:
    """One role's pool of instances; a unary call goes to one of them, failing over (`with_failover`)."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    async def _unary(self, ctx: RequestContext, method: str, request: Any,
                     key: str | None = None) -> tuple[Any, Instance]:
        async def attempt(instance: Instance) -> Any:
            with self.pool.track(instance):
                return await getattr(instance.stub, method)(request, timeout=ctx.time_left(),
                                                            metadata=call_metadata(ctx))

        return await with_failover(self.pool, ctx, method, attempt, key)


class RenderClient(RoleClient):
    async def chat(self, ctx: RequestContext, body: bytes) -> tuple[pb.RenderResponse, Instance]:
        """An OpenAI chat request body -> token ids, items and sampling."""
        request = pb.RenderChatRequest(request_id=ctx.request_id, chat_request_json=body)
        return await self._unary(ctx, "RenderChat", request)

    async def completion(self, ctx: RequestContext, body: bytes) -> tuple[pb.RenderResponse, Instance]:
        request = pb.RenderCompletionRequest(request_id=ctx.request_id, completion_request_json=body)
        return await self._unary(ctx, "RenderCompletion", request)

    async def content_parts(self, ctx: RequestContext,
                            request: pb.RenderContentPartsRequest) -> tuple[pb.RenderResponse, Instance]:
        return await self._unary(ctx, "RenderContentParts", request)


class EncodeClient(RoleClient):
    async def encode(self, ctx: RequestContext, item: pb.MultiModalItem) -> tuple[pb.EncodedItem, Instance]:
        """One item encoded (or found stored) by one encoder, chosen by its mm_hash."""
        request = pb.EncodeRequest(request_id=ctx.request_id, items=[item])
        reply, instance = await self._unary(ctx, "Encode", request, key=item.mm_hash)
        if len(reply.items) != 1 or reply.items[0].mm_hash != item.mm_hash:
            raise InternalError(f"encode answered {len(reply.items)} items for one", code="encode_incomplete")
        return reply.items[0], instance


class PrefillClient(RoleClient):
    async def prefill(self, ctx: RequestContext, request: pb.PrefillRequest) -> tuple[pb.PrefillResponse, Instance]:
        return await self._unary(ctx, "Prefill", request)
