"""A request for n samples whose decode instance failed mid-stream: each unfinished sample resumed on its own.

A fresh request for n samples is one decode call (decode forks the samples from one prompt KV:
services/decode/samples.py).  When that call's instance dies, the samples the client has not seen
finish have each their own output so far, so each is resumed as a request of one sample: prefill the
prompt and that sample's tokens but the last (the prefix cache makes the prompt part cheap), then
decode from its last token with the tokens named (DecodeRequest.resumed_token_ids), seeded with
seed + index (the draw sample i would have made: services/generation/params.py sample_params).  Each runs
the pipeline's own prefill and decode steps over a context of its own (its own id and recoveries; the
deadlines and the transport retry budget are the request's), and their streams are merged back into
one, each delta carrying its sample's index.  A sample that had no token yet simply starts again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from services.protocol.answers import OutputDelta
from services.rpc.v1 import epd_pb2 as pb

from .context import OpenStream, RequestContext


def num_samples(sampling: pb.SamplingParams) -> int:
    return sampling.n if sampling.HasField("n") and sampling.n > 0 else 1


def sample_context(ctx: RequestContext, index: int, sent: list[int]) -> RequestContext:
    """The context resuming sample `index` alone (n = 1, its own seed) after the tokens `sent`."""
    sampling = pb.SamplingParams()
    sampling.CopyFrom(ctx.sampling)
    sampling.n = 1
    if sampling.HasField("seed"):
        sampling.seed = sampling.seed + index
    return dataclasses.replace(ctx, request_id=f"{ctx.request_id}.s{index}", sampling=sampling, resumed=list(sent),
                               prefill=None, decode_stream=None, recovered=set(), instances={}, timings={})


class MergedStreams:
    """Several samples' decode streams as one: each delta tagged with its sample's index (OpenStream)."""

    def __init__(self, streams: dict[int, OpenStream]) -> None:
        self.streams = streams

    async def chunks(self) -> AsyncIterator[OutputDelta]:
        queue: asyncio.Queue[tuple[int, OutputDelta | None, BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: OpenStream) -> None:
            try:
                async for delta in stream.chunks():
                    queue.put_nowait((index, delta, None))
                queue.put_nowait((index, None, None))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((index, None, exc))

        tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in self.streams.items()]
        left = len(tasks)
        try:
            while left:
                index, delta, error = await queue.get()
                if error is not None:
                    raise error
                if delta is None:
                    left -= 1
                    continue
                yield dataclasses.replace(delta, index=index)
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()


async def resume_each(ctx: RequestContext, sent: dict[int, list[int]], done: set[int],
                      run: Callable[[RequestContext], Awaitable[None]]) -> MergedStreams:
    """Every unfinished sample of `ctx` prefilled and opened again on its own (`run` runs the pipeline from
    prefill over a sample's context); their streams merged (ctx.decode_stream)."""
    contexts = {index: sample_context(ctx, index, sent.get(index, []))
                for index in range(num_samples(ctx.sampling)) if index not in done}
    try:
        await asyncio.gather(*(run(child) for child in contexts.values()))
    except BaseException:
        for child in contexts.values():
            if child.decode_stream is not None:
                child.decode_stream.close()
        raise
    streams = {index: child.decode_stream for index, child in contexts.items() if child.decode_stream is not None}
    return MergedStreams(streams)
