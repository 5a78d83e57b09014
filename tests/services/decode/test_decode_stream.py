"""DecodeStream: thread-safe delivery, blocking and asyncio consumption, timeouts, nothing after the end."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.decode.stream import DecodeEvent, DecodeStream, StreamTimeout


def _events(n: int) -> list[DecodeEvent]:
    return [DecodeEvent("r", [i], str(i), "length" if i == n - 1 else None, completion_tokens=i + 1)
            for i in range(n)]


def test_blocking_iteration_across_threads():
    stream = DecodeStream("r", timeout=5)
    producer = threading.Thread(target=lambda: [stream.put(e) for e in _events(50)])
    producer.start()
    assert [e.token_ids[0] for e in stream] == list(range(50))
    producer.join(5)
    assert stream.finished


def test_nothing_follows_the_final_event():
    stream = DecodeStream("r", timeout=5)
    for event in _events(2) + [DecodeEvent("r", [99])]:
        stream.put(event)
    assert len(stream.collect()) == 2
    with pytest.raises(StreamTimeout):
        stream.get(timeout=0.05)


def test_get_times_out():
    with pytest.raises(StreamTimeout):
        DecodeStream("r").get(timeout=0.05)


def test_async_consumer_keeps_events_put_before_it_attached():
    stream = DecodeStream("r", timeout=5)
    events = _events(20)
    for event in events[:5]:
        stream.put(event)

    async def consume() -> list[int]:
        later = threading.Thread(target=lambda: [stream.put(e) for e in events[5:]])
        later.start()   # races with attaching: either way every event arrives, in order
        out = [event.token_ids[0] async for event in stream.events()]
        later.join(5)
        return out

    assert asyncio.run(consume()) == list(range(20))


def test_async_timeout():
    async def consume() -> None:
        async for _ in DecodeStream("r").events(timeout=0.05):
            pass

    with pytest.raises(StreamTimeout):
        asyncio.run(consume())
