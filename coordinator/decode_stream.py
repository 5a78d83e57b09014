"""One Decode call: opened with failover, then read to the end.

`open_decode` starts the server stream and waits for its first chunk (decode
emits the first token at once), so everything that can go wrong before any
token reaches the client is still recoverable and still a plain HTTP error:

- the instance is gone (transport failure) -> it is marked down and the call
  goes to another decode instance;
- the instance is full (Overloaded) -> another instance; all full -> 429;
- the KV entry is gone (kv_entry_missing: evicted, expired, or consumed by
  an instance that died) -> prefill runs again (once) and decode is retried.

After the first chunk, `DecodeStream.chunks` reads the rest.  Tokens already
sent cannot be replayed elsewhere, so an instance that dies mid-stream ends
the stream with Unavailable (`decode_failed`), which the endpoints send
in-stream; a SIGKILLed instance's connection resets at once, and channel
keepalive catches a peer that vanished silently.  `close()` cancels the call
(the decode role aborts the request, freeing its slot) and is idempotent:
the stream's end and the request's cleanup both call it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.protocol.errors import DeadlineExceeded, EpdError, InternalError, Overloaded, Unavailable
from services.rpc.v1 import epd_pb2 as pb

from .clients import (
    call_metadata,
    count_call,
    error_from_rpc,
    is_transport_failure,
    on_refusal,
    on_transport_failure,
    pick_next,
)
from .context import RequestContext
from .routing.pool import Instance, InstancePool

KV_MISSING_CODE = "kv_entry_missing"


class DecodeStream:
    def __init__(self, pool: InstancePool, instance: Instance, call: grpc.aio.UnaryStreamCall,
                 first: pb.DecodeChunk, ctx: RequestContext) -> None:
        self.pool, self.instance, self.call, self.first, self.ctx = pool, instance, call, first, ctx
        self._closed = False

    async def chunks(self) -> AsyncIterator[pb.DecodeChunk]:
        try:
            yield self.first
            while True:
                chunk = await self.call.read()
                if chunk is grpc.aio.EOF:
                    return
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise self._failure(exc) from None
        finally:
            self.close()

    def _failure(self, exc: grpc.aio.AioRpcError) -> EpdError:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"request {self.ctx.request_id} exceeded its deadline in decode")
        if is_transport_failure(exc):
            self.pool.mark_down(self.instance, f"Decode stream: {exc.code().name}")
            count_call(self.pool, self.instance, "failed")
            return Unavailable(f"decode instance {self.instance.address} failed mid-stream "
                               f"({exc.code().name}); the tokens sent so far are all there will be",
                               code="decode_failed")
        return error_from_rpc(exc)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.call.cancel()
            self.pool.end(self.instance)


async def open_decode(pool: InstancePool, ctx: RequestContext, build: Callable[[], pb.DecodeRequest],
                      reprefill: Callable[[RequestContext], Awaitable[None]]) -> DecodeStream:
    """A running Decode call with its first chunk read; see the module doc for the retries."""
    tried: set[str] = set()
    refused: Overloaded | None = None
    reprefilled = False
    while True:
        instance = pick_next(pool, None, tried, refused)
        tried.add(instance.address)
        started = time.perf_counter()
        outcome = await _first_chunk(pool, instance, ctx, build())
        if isinstance(outcome, DecodeStream):
            count_call(pool, instance, "ok")
            ctx.instances["decode"] = instance.address
            ctx.timings["decode_first_chunk"] = time.perf_counter() - started
            return outcome
        if is_transport_failure(outcome):
            on_transport_failure(pool, instance, ctx, f"Decode: {outcome.code().name}")
            continue
        err = error_from_rpc(outcome)
        if isinstance(err, Overloaded):
            on_refusal(pool, instance)
            refused = err
        elif err.code == KV_MISSING_CODE and not reprefilled:
            _count_retry(pool, KV_MISSING_CODE)
            reprefilled = True
            await reprefill(ctx)
            tried.clear()
        else:
            raise err


async def _first_chunk(pool: InstancePool, instance: Instance, ctx: RequestContext,
                       request: pb.DecodeRequest) -> DecodeStream | grpc.aio.AioRpcError:
    pool.begin(instance)
    call = instance.stub.Decode(request, timeout=ctx.time_left(), metadata=call_metadata(ctx))
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as exc:
        call.cancel()
        pool.end(instance)
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise DeadlineExceeded(f"request {ctx.request_id} exceeded its deadline in decode") from None
        return exc
    except BaseException:
        call.cancel()
        pool.end(instance)
        raise
    if first is grpc.aio.EOF:
        pool.end(instance)
        raise InternalError("decode ended the stream without any output", code="decode_error")
    return DecodeStream(pool, instance, call, first, ctx)


def _count_retry(pool: InstancePool, reason: str) -> None:
    if pool.metrics is not None:
        pool.metrics.retries.labels(pool.role, reason).inc()
