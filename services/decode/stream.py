"""What a decode request hands back: a stream of `DecodeEvent`s.

The engine's worker thread `put`s events; one consumer reads them, either
from a thread (`for event in stream`, blocking, `timeout` per event) or from
asyncio (`async for event in stream.events()`: events hop onto the consumer's
loop with call_soon_threadsafe).  A request for n samples has one stream for all
of them (each event names its sample: `index`); the stream ends with the last
sample's final event (the one with a finish_reason, for n = 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from services.protocol.logprobs import TokenLogprob


@dataclass(frozen=True)
class DecodeEvent:
    """One step of one request: the new ids, the text they made safe to show, and maybe the end."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None   # the stop token id or stop string; None for EOS
    completion_tokens: int = 0             # output tokens so far, this event's included
    error: str | None = None               # set with finish_reason "error"
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs
    index: int = 0                         # which of the request's n samples (sampling_params.n)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StreamTimeout(TimeoutError):
    """No event arrived within the consumer's timeout."""


class DecodeStream:
    """Thread-safe, single-consumer event stream of one request."""

    def __init__(self, request_id: str, timeout: float | None = 60.0, samples: int = 1) -> None:
        self.request_id = request_id
        self.timeout = timeout
        self._samples = samples
        self._open = samples   # samples whose final event has not come yet
        self._read = 0         # final events the consumer has read
        self._events: deque[DecodeEvent] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[DecodeEvent] | None = None
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def put(self, event: DecodeEvent) -> None:
        """Called by the engine thread."""
        with self._cond:
            if self._finished:
                return  # nothing follows the last final event
            self._open -= event.finished
            self._finished = self._open <= 0
            if self._loop is not None and self._queue is not None:
                with contextlib.suppress(RuntimeError):   # the consumer's loop is closed: nobody is listening any more
                    self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
            else:
                self._events.append(event)
                self._cond.notify_all()

    def get(self, timeout: float | None = None) -> DecodeEvent:
        """The next event; raises StreamTimeout after `timeout` (default: the stream's) seconds."""
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._events, timeout):
                raise StreamTimeout(f"no decode event for {self.request_id} within {timeout}s")
            event = self._events.popleft()
            self._read += event.finished
            return event

    def __iter__(self) -> Iterator[DecodeEvent]:
        while self._read < self._samples:
            yield self.get()

    def collect(self, timeout: float | None = None) -> list[DecodeEvent]:
        """All events until the last final one (blocking)."""
        events: list[DecodeEvent] = []
        while self._read < self._samples:
            events.append(self.get(timeout))
        return events

    async def events(self, timeout: float | None = None) -> AsyncIterator[DecodeEvent]:
        """Async iteration on the running loop; raises StreamTimeout like `get`."""
        queue = self._attach(asyncio.get_running_loop())
        timeout = self.timeout if timeout is None else timeout
        while self._read < self._samples:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that lands as an event arrives
                async with asyncio.timeout(timeout):
                    event = await queue.get()
            except TimeoutError as exc:
                raise StreamTimeout(f"no decode event for {self.request_id} within {timeout}s") from exc
            self._read += event.finished
            yield event

    def _attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[DecodeEvent]:
        with self._cond:
            if self._queue is None:
                self._loop, self._queue = loop, asyncio.Queue()
                # Events that arrived before the consumer attached keep their order.
                while self._events:
                    self._queue.put_nowait(self._events.popleft())
            return self._queue
