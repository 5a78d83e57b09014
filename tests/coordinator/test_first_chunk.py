"""The decode stream that starts with prefill's first chunk (docs/architecture.md, "The first token leaves with
prefill's answer"): it reads decode's own first chunk and checks it against the one the client has.

A decode that judges a first token differently from prefill needs two roles configured apart (another tokenizer or
--max-model-len), which `epd serve` never does, and a decode that fails in the tenths of a millisecond between the
two chunks cannot be timed on demand; so these tests drive the stream with a FAKE call whose chunks they script.
The real path (same chunk, counted `same`) runs in tests/e2e/test_fast_lane.py.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from coordinator.context import RequestContext
from coordinator.decode_stream import DecodeStream
from coordinator.metrics import CoordinatorMetrics
from services.protocol.errors import InternalError, Unavailable
from services.rpc.v1 import epd_pb2 as pb

EARLY = pb.DecodeChunk(token_ids=[5], text="a")


class FakeCall:
    """FAKE gRPC stream call: `read()` gives the scripted chunks in turn (an exception is raised)."""

    def __init__(self, *chunks: object) -> None:
        self.chunks, self.cancelled = list(chunks), False

    async def read(self) -> object:
        await asyncio.sleep(0)
        item = self.chunks.pop(0) if self.chunks else grpc.aio.EOF
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Pool:
    role = "decode"

    def __init__(self) -> None:
        self.metrics = CoordinatorMetrics(CollectorRegistry())
        self.ended = self.marked_down = 0

    def end(self, instance: object) -> None:
        self.ended += 1

    def mark_down(self, instance: object, why: str) -> None:
        self.marked_down += 1


class Instance:
    address = "127.0.0.1:1"


def _run(call: FakeCall) -> tuple[list[tuple[list[int], str]], BaseException | None, dict[str, float], Pool]:
    pool = Pool()
    ctx = RequestContext(request_id="r1", deadline=time.monotonic() + 10, label="r1")
    stream = DecodeStream(pool, Instance(), call, EARLY, ctx, from_prefill=True)   # type: ignore[arg-type]

    async def main() -> tuple[list, BaseException | None]:
        got: list = []
        try:
            async for delta in stream.chunks():
                got.append((delta.token_ids, delta.text))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return got, exc
        return got, None

    got, error = asyncio.run(main())
    counts = {s.labels["outcome"]: s.value for s in pool.metrics.first_chunks.collect()[0].samples
              if s.name.endswith("_total")}
    return got, error, counts, pool


def test_decodes_own_first_chunk_is_checked_and_dropped_then_the_rest_streams():
    call = FakeCall(pb.DecodeChunk(token_ids=[5], text="a"), pb.DecodeChunk(token_ids=[6], text="b"),
                    pb.DecodeChunk(token_ids=[7], text="c", finish_reason="length"))
    got, error, counts, pool = _run(call)
    assert error is None and got == [([5], "a"), ([6], "b"), ([7], "c")]
    assert counts == {"same": 1.0} and call.cancelled and pool.ended == 1


def test_a_first_chunk_decode_judges_differently_ends_the_answer_with_an_error():
    got, error, counts, _ = _run(FakeCall(pb.DecodeChunk(token_ids=[5], text="a", finish_reason="stop"),
                                          pb.DecodeChunk(token_ids=[6], text="b")))
    assert got == [([5], "a")]
    assert isinstance(error, InternalError) and error.code == "first_chunk_mismatch"
    assert "--max-model-len" in error.message and counts == {"different": 1.0}


@pytest.mark.parametrize("failure", ["transport", "eof"])
def test_a_decode_that_fails_before_its_first_chunk_ends_the_answer_in_stream(failure):
    dead = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "reset")
    got, error, counts, pool = _run(FakeCall(dead) if failure == "transport" else FakeCall())
    assert got == [([5], "a")] and counts == {"missing": 1.0}
    if failure == "transport":
        assert isinstance(error, Unavailable) and error.code == "decode_failed" and pool.marked_down == 1
    else:
        assert isinstance(error, InternalError) and error.code == "decode_error"
