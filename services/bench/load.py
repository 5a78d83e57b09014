"""Issuing requests: a closed loop of N workers, or open-loop gamma arrivals.

Arrivals follow vLLM's `--request-rate` / `--burstiness`: inter-arrival times
are gamma distributed with shape = burstiness and scale = 1 / (rate *
burstiness), so their mean is always 1/rate; burstiness 1 is a Poisson
process, < 1 burstier, > 1 more regular (coefficient of variation
1/sqrt(burstiness)). A concurrency cap in open-loop mode queues arrivals on
the client; their TTFT is counted from the actual send, as in vLLM.

With a duration, no request starts after it; those in flight finish and
count. The run's duration is from the first send to the last completion.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .config import LoadConfig
from .progress import NoProgress, Progress
from .stream import RequestResult
from .workloads import BenchRequest, Workload

Send = Callable[[BenchRequest], Awaitable[RequestResult]]


def arrival_intervals(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds between consecutive arrivals (endless)."""
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    while True:
        yield float(rng.gamma(burstiness, scale))


class RequestSource(Protocol):
    async def next(self) -> BenchRequest | None: ...


class ListSource:
    def __init__(self, requests: list[BenchRequest]) -> None:
        self._it = iter(requests)

    async def next(self) -> BenchRequest | None:
        return next(self._it, None)


class PrefetchSource:
    """Builds requests in a thread, at most `lookahead` ahead, so image encoding
    happens before the clock starts (prime) and off the event loop afterwards."""

    def __init__(self, workload: Workload, count: int | None, lookahead: int) -> None:
        self._queue: queue.Queue[BenchRequest | BaseException | None] = queue.Queue(maxsize=lookahead)
        self._target = lookahead if count is None else min(count, lookahead)
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(workload, count), daemon=True)
        self._thread.start()

    def _produce(self, workload: Workload, count: int | None) -> None:
        index = 0
        try:
            while (count is None or index < count) and not self._stop.is_set():
                self._put(workload.build(index))
                index += 1
            self._put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(exc)
        finally:
            self._finished.set()

    def _put(self, item: BenchRequest | BaseException | None) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    async def prime(self) -> None:
        while self._queue.qsize() < self._target and not self._finished.is_set():
            await asyncio.sleep(0.005)

    async def next(self) -> BenchRequest | None:
        while True:  # polling: only waits when the builder is behind, and leaves no thread blocked
            try:
                item = self._queue.get_nowait()
                break
            except queue.Empty:
                await asyncio.sleep(0.002)
        if isinstance(item, BaseException):
            raise item
        if item is None:
            self._queue.put_nowait(None)  # every later caller (one per worker) sees the end too
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration_s: float


async def run_load(send: Send, source: RequestSource, load: LoadConfig, arrival_seed: int,
                   progress: Progress | None = None) -> LoadRun:
    progress = progress or NoProgress()
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + load.duration_s if load.duration_s else math.inf

    async def issue(request: BenchRequest) -> None:
        result = await send(request)
        results.append(result)
        progress.update(result.ok)

    if load.is_open_loop:
        await _open_loop(issue, source, load, arrival_seed, start, deadline)
    else:
        await _closed_loop(issue, source, load.max_in_flight or 1, deadline)
    return LoadRun(sorted(results, key=lambda r: r.index), time.perf_counter() - start)


async def _closed_loop(issue: Callable[[BenchRequest], Awaitable[None]], source: RequestSource,
                       workers: int, deadline: float) -> None:
    async def worker() -> None:
        while time.perf_counter() < deadline:
            request = await source.next()
            if request is None:
                return
            await issue(request)

    await asyncio.gather(*(worker() for _ in range(workers)))


async def _open_loop(issue: Callable[[BenchRequest], Awaitable[None]], source: RequestSource,
                     load: LoadConfig, seed: int, start: float, deadline: float) -> None:
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def limited(request: BenchRequest) -> None:
        if cap is None:
            return await issue(request)
        async with cap:
            await issue(request)

    tasks: list[asyncio.Task[None]] = []
    due = start
    for interval in arrival_intervals(load.request_rate, load.burstiness, seed):
        request = await source.next()
        if request is None:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(limited(request)))
        due += interval
    await asyncio.gather(*tasks)
