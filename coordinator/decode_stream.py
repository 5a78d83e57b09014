"""One Decode call: opened with failover, then read to the end.

`open_decode` starts the server stream and waits for its first chunk (decode
emits the first token at once), so everything that can go wrong before any
token reaches the client is still recoverable and still a plain HTTP error:

- the instance is gone (transport failure) -> it is marked down and the call
  goes to another decode instance;
- the instance is full (Overloaded) -> another instance; all full -> 429;
- the KV entry is gone (kv_entry_missing: evicted, expired, or consumed by
  an instance that died) -> the typed error goes up to the pipeline, whose
  recovery policy runs prefill again (once) and then this step again.

Both retries are the one failover loop of clients.py (`with_failover`).

A call opened ahead acknowledges its reservation first (`ack_reserved`); when prefill's answer carries the
first chunk (services/decode/judge.py), that ack is enough: the stream starts with prefill's chunk and checks
decode's own first chunk against it when it comes (docs/architecture.md, "The first token leaves with
prefill's answer"; a failure in between is in-stream, as below).

After the first chunk, `DecodeStream.chunks` reads the rest.  Tokens already
sent cannot be replayed elsewhere, so an instance that dies mid-stream ends
the stream with Unavailable (`decode_failed`), which the endpoints send
in-stream; a SIGKILLed instance's connection resets at once, and channel
keepalive catches a peer that vanished silently.  `close()` cancels the call
(the decode role aborts the request, freeing its slot) and is idempotent:
the stream's end and the request's cleanup both call it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from services.protocol.answers import OutputDelta, protocol_finish_reason
from services.protocol.errors import DeadlineExceeded, EpdError, InternalError, Unavailable
from services.protocol.logprobs import loads_list
from services.rpc.convert import loads
from services.rpc.v1 import epd_pb2 as pb

from .clients import call_metadata, count_call, error_from_rpc, is_transport_failure, with_failover
from .context import RequestContext
from .routing.pool import Instance, InstancePool

if TYPE_CHECKING:
    from .ahead import Ahead


class DecodeStream:
    def __init__(self, pool: InstancePool, instance: Instance, call: grpc.aio.UnaryStreamCall,
                 first: pb.DecodeChunk, ctx: RequestContext, from_prefill: bool = False) -> None:
        self.pool, self.instance, self.call, self.first, self.ctx = pool, instance, call, first, ctx
        self.from_prefill = from_prefill   # `first` is prefill's: decode's own first chunk is still to come
        self._closed = False

    async def chunks(self) -> AsyncIterator[OutputDelta]:
        """Every chunk, the first included, as answer deltas; closes the call at the end."""
        try:
            yield chunk_delta(self.first, self.ctx.sampling)
            if self.from_prefill:
                await self._confirm_first()
            while True:
                chunk = await self._next()
                if chunk is grpc.aio.EOF:
                    return
                yield chunk_delta(chunk, self.ctx.sampling)
        except grpc.aio.AioRpcError as exc:
            raise self._failure(exc) from None
        finally:
            self.close()

    async def _confirm_first(self) -> None:
        """Decode's own first chunk, read and dropped: it must be the one prefill judged and the client has."""
        metrics = self.pool.metrics
        try:
            own = await self._next()
        except Exception:   # decode failed (a client that left cancels the stream: not counted)
            if metrics is not None:
                metrics.first_chunks.labels("missing").inc()
            raise
        same = own is not grpc.aio.EOF and _judged(own) == _judged(self.first)
        if metrics is not None:
            metrics.first_chunks.labels("same" if same else "different" if own is not grpc.aio.EOF else "missing").inc()
        if own is grpc.aio.EOF:
            raise InternalError("decode ended the stream without any output", code="decode_error")
        if not same:   # prefill and decode judge by one rule (services/decode/judge.py): their configs differ
            raise InternalError(f"decode's first chunk {_judged(own)} is not prefill's {_judged(self.first)}: do "
                                "prefill and decode serve the same model, tokenizer and --max-model-len?",
                                code="first_chunk_mismatch")

    async def _next(self) -> pb.DecodeChunk | object:
        """The next chunk within the stall bound (--stream-idle-timeout-s)."""
        idle = self.ctx.idle_s
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that lands as a chunk arrives
            async with asyncio.timeout(None if idle == math.inf else idle):
                return await self.call.read()
        except TimeoutError:
            raise DeadlineExceeded(f"request {self.ctx.label} got no token for {idle:g} s "
                                   "(--stream-idle-timeout-s); the answer is cut", code="stream_idle_timeout") from None

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


async def open_decode(pool: InstancePool, ctx: RequestContext, request: Callable[[], pb.DecodeRequest],
                      ahead: Ahead | None = None) -> DecodeStream:
    """A running Decode call with its first chunk read; fails over between decode instances.

    `request` builds the whole call; with `ahead` (the call opened ahead of its inputs, coordinator/ahead.py)
    the first attempt sends it prefill's answer instead.  A missing KV entry comes back as NotFound
    `kv_entry_missing`: the pipeline's recovery policy, not this call, decides to prefill again.
    """
    def attempt(instance: Instance) -> Awaitable[DecodeStream]:
        if ahead is not None and not ahead.used and instance is ahead.instance:
            assert ctx.prefill is not None
            first_token = ctx.time_left()
            # Its in-flight count (pool.begin at opening) is now the stream's: DecodeStream.close ends it.
            ahead.ended = True
            return _read_first(pool, instance, ctx, ahead.take(lambda: ctx.prefill).stream, first_token)
        return _first_chunk(pool, instance, ctx, request())

    stream, _ = await with_failover(pool, ctx, "Decode", attempt, first=ahead.instance if ahead else None)
    return stream


async def _first_chunk(pool: InstancePool, instance: Instance, ctx: RequestContext,
                       request: pb.DecodeRequest) -> DecodeStream:
    # The call lives as long as the answer may (the total deadline); its first chunk comes within the
    # first-token bound.
    total, first_token = ctx.total_left(), ctx.time_left()
    pool.begin(instance)
    call = instance.stub.Decode(request, timeout=total, metadata=call_metadata(ctx))
    return await _read_first(pool, instance, ctx, call, first_token)


async def _read_first(pool: InstancePool, instance: Instance, ctx: RequestContext, call: grpc.aio.UnaryStreamCall,
                      first_token: float) -> DecodeStream:
    """The open call's first chunk within `first_token` seconds; the call is cancelled (and the instance's
    in-flight count given back) when there is none."""
    early: pb.DecodeChunk | None = None
    try:
        async with asyncio.timeout(None if first_token == math.inf else first_token):
            first = await call.read()
            if first is not grpc.aio.EOF and first.reserved:   # decode took the request (ack_reserved)
                early = _prefill_first_chunk(ctx)
                if early is None:
                    first = await call.read()
    except TimeoutError:
        call.cancel()
        pool.end(instance)
        raise DeadlineExceeded(f"request {ctx.label} had no first token within its time-to-first-token bound "
                               "(--ttft-timeout-s)", code="ttft_timeout") from None
    except grpc.aio.AioRpcError as exc:
        call.cancel()
        pool.end(instance)
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise DeadlineExceeded(f"request {ctx.request_id} exceeded its deadline in decode") from None
        raise
    except BaseException:
        call.cancel()
        pool.end(instance)
        raise
    if early is not None:   # the client gets prefill's first chunk now; decode's own is checked against it
        return DecodeStream(pool, instance, call, early, ctx, from_prefill=True)
    if first is grpc.aio.EOF:
        pool.end(instance)
        raise InternalError("decode ended the stream without any output", code="decode_error")
    return DecodeStream(pool, instance, call, first, ctx)


def _prefill_first_chunk(ctx: RequestContext) -> pb.DecodeChunk | None:
    """Prefill's answer's first chunk (PrefillRequest.first_chunk), when it has one."""
    return ctx.prefill.first_chunk if ctx.prefill is not None and ctx.prefill.HasField("first_chunk") else None


def _judged(chunk: pb.DecodeChunk) -> tuple:
    """What a first chunk says about its token: what prefill and decode must agree on."""
    return (list(chunk.token_ids), chunk.text, chunk.finish_reason, chunk.stop_reason)


def chunk_delta(chunk: pb.DecodeChunk, sampling: pb.SamplingParams) -> OutputDelta:
    """A gRPC decode chunk as the answer builder takes it."""
    return OutputDelta(token_ids=list(chunk.token_ids), text=chunk.text,
                       finish_reason=protocol_finish_reason(chunk.finish_reason),
                       stop_reason=stop_reason(chunk.stop_reason, sampling),
                       logprobs=loads_list(loads(chunk.logprobs_json)) if chunk.logprobs_json else None)


def stop_reason(text: str, sampling: pb.SamplingParams) -> int | str | None:
    """gRPC carries stop_reason as text; give a stop token id back as an int (as decode answers it)."""
    if not text:
        return None
    if text.isdigit() and int(text) in sampling.stop_token_ids and text not in sampling.stop:
        return int(text)
    return text
