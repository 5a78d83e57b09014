"""A cancel that lands in the same loop iteration as the awaited result is not lost.

Python 3.11's `asyncio.wait_for` returns the inner result and drops the cancel in that case (fixed in
3.12).  The coordinator reads every decode chunk under a stall bound, and decode every engine event:
with wait_for, a client that disconnected from a long non-streaming answer could see its cancel dropped
at one of a thousand chunk reads and the answer run to its end (a full suite saw it: 200 after 6.4 s
instead of a counted disconnect).  The race needs the result and the cancel in one iteration, which a
real gRPC stream cannot be made to do on demand, so each test drives the reader with a FAKE call or
queue that it completes itself, then cancels at once.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from coordinator.decode_stream import DecodeStream as CoordinatorStream
from services.decode.stream import DecodeEvent
from services.decode.stream import DecodeStream as EngineStream


class FakeCall:
    """FAKE gRPC call: `read()` waits for a future the test resolves."""

    def __init__(self) -> None:
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()

    async def read(self) -> object:
        return await self.future


class Ctx:
    def __init__(self, idle_s: float) -> None:
        self.idle_s, self.label = idle_s, "r"


async def _cancel_as_it_arrives(task: asyncio.Task, deliver) -> None:
    for _ in range(3):
        await asyncio.sleep(0)     # the reader is waiting now
    deliver()
    task.cancel()                  # same iteration: the result is there and so is the cancel
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("idle_s", [30.0, math.inf])
def test_a_chunk_read_keeps_a_cancel_that_lands_with_the_chunk(idle_s):
    async def main() -> None:
        stream = object.__new__(CoordinatorStream)
        stream.call, stream.ctx = FakeCall(), Ctx(idle_s)
        task = asyncio.create_task(stream._next())
        await _cancel_as_it_arrives(task, lambda: stream.call.future.set_result("chunk"))

    asyncio.run(main())


def test_an_engine_event_read_keeps_a_cancel_that_lands_with_the_event():
    async def main() -> None:
        stream = EngineStream("r", timeout=30.0)
        events = stream.events()
        task = asyncio.create_task(anext(events))
        event = DecodeEvent("r", token_ids=[1], text="a")
        # put() hands the event to the loop with call_soon_threadsafe; that callback's own step is this:
        await _cancel_as_it_arrives(task, lambda: stream._queue.put_nowait(event))

    asyncio.run(main())


def test_wait_for_drops_such_a_cancel_on_this_python_or_the_test_above_proves_nothing_new():
    """The control: what the readers above no longer do (documents why they use asyncio.timeout)."""
    import sys

    async def main() -> object:
        future = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(asyncio.wait_for(future, 30.0))
        for _ in range(3):
            await asyncio.sleep(0)
        future.set_result("chunk")
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    outcome = asyncio.run(main())
    assert outcome == ("chunk" if sys.version_info < (3, 12) else "cancelled")
