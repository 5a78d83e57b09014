"""Decode calls: `DecodeClient.open` starts one (with failover), `DecodeStream` reads it to the end.

`open` starts the server stream and waits for its first chunk (decode emits the first token at once), so
everything that can go wrong before any token reaches the client is still recoverable and still a plain HTTP
error:

- the instance is gone (transport failure) -> it is marked down and the call goes to another decode
  instance;
- the instance is full (Overloaded) -> another instance; all full -> 429;
- the KV entry is gone (kv_entry_missing: evicted, expired, or consumed by an instance that died) -> the
  typed error goes up to the pipeline, whose recovery policy runs prefill again (once) and then this step
  again.

Both retries are the one failover loop of clients.py (`with_failover`).

After the first chunk, `DecodeStream.chunks` reads the rest.  An instance that dies mid-stream (a transport
failure: a SIGKILLed process's connection resets at once, channel keepalive catches a peer that vanished
silently) is marked down and counted against the request's retry budget, and `chunks` raises
`DecodeFailed`: the pipeline then resumes the answer on another instance (coordinator/pipeline.py), so the
client sees neither the failure nor a repeated or missing token.  `close()` cancels the call (the decode role
aborts the request, freeing its slot) and is idempotent: the stream's end and the request's cleanup both call
it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import grpc

from services.protocol.answers import OutputDelta, protocol_finish_reason
from services.protocol.errors import DeadlineExceeded, EpdError, InternalError, Unavailable
from services.protocol.logprobs import loads_list
from services.rpc.convert import loads
from services.rpc.v1 import epd_pb2 as pb

from .clients import (
    RoleClient,
    call_metadata,
    error_from_rpc,
    is_transport_failure,
    on_transport_failure,
    with_failover,
)
from .context import RequestContext
from .routing.pool import Instance, InstancePool


class DecodeFailed(Unavailable):
    """The decode instance serving a stream failed after its first chunk (a transport failure): the tokens the
    client has are all this instance will send; the pipeline resumes the answer elsewhere."""


class DecodeStream:
    def __init__(self, pool: InstancePool, instance: Instance, call: grpc.aio.UnaryStreamCall,
                 first: pb.DecodeChunk, ctx: RequestContext) -> None:
        self.pool, self.instance, self.call, self.first, self.ctx = pool, instance, call, first, ctx
        self._closed = False

    async def chunks(self) -> AsyncIterator[OutputDelta]:
        """Every chunk, the first included, as answer deltas; closes the call at the end."""
        try:
            yield chunk_delta(self.first, self.ctx.sampling)
            while True:
                chunk = await self._next()
                if chunk is grpc.aio.EOF:
                    return
                yield chunk_delta(chunk, self.ctx.sampling)
        except grpc.aio.AioRpcError as exc:
            raise self._failure(exc) from None
        finally:
            self.close()

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
            self.close()
            on_transport_failure(self.pool, self.instance, self.ctx, f"Decode stream: {exc.code().name}")
            return DecodeFailed(f"decode instance {self.instance.address} failed mid-stream ({exc.code().name})",
                                code="decode_failed")
        return error_from_rpc(exc)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.call.cancel()
            self.pool.end(self.instance)


class DecodeClient(RoleClient):
    async def open(self, ctx: RequestContext, request: pb.DecodeRequest) -> DecodeStream:
        """A running Decode call with its first chunk read; fails over between decode instances.  A missing KV
        entry comes back as NotFound `kv_entry_missing`: the pipeline's recovery policy, not this call, decides
        to prefill again."""
        async def attempt(instance: Instance) -> DecodeStream:
            return await _first_chunk(self.pool, instance, ctx, request)

        stream, _ = await with_failover(self.pool, ctx, "Decode", attempt)
        return stream


async def _first_chunk(pool: InstancePool, instance: Instance, ctx: RequestContext,
                       request: pb.DecodeRequest) -> DecodeStream:
    """The call (it lives as long as the answer may: the total deadline) and its first chunk, read within the
    first-token bound; the call is cancelled (and the instance's in-flight count given back) when there is none."""
    total, first_token = ctx.total_left(), ctx.time_left()
    pool.begin(instance)
    call = instance.stub.Decode(request, timeout=total, metadata=call_metadata(ctx))
    try:
        async with asyncio.timeout(None if first_token == math.inf else first_token):
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
    if first is grpc.aio.EOF:
        pool.end(instance)
        raise InternalError("decode ended the stream without any output", code="decode_error")
    return DecodeStream(pool, instance, call, first, ctx)


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
