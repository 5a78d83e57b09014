"""One `epd bench` invocation: model lookup, calibration, warm-up, then each load level
(one, or one per --sweep concurrency) on one endpoint or alternately on two.

Compare mode: the requests of a level are cut into rounds; each round is
built once and sent to both endpoints, one after the other, the order
flipping every round (A B, B A, ...), so both see the same requests in the
same order, the same arrival times, and the same machine conditions give or
take one round. Each endpoint's duration is the sum of its rounds.

Seeds: levels of a sweep use distinct workload seeds, so a level never finds
the images of an earlier one in the encoder cache; warm-up requests use
another seed for the same reason. Both endpoints always get the same seeds.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from . import prom
from .calibrate import calibrate
from .client import ChatClient, first_model, new_session
from .config import BenchConfig, Endpoint, LoadConfig
from .load import ListSource, PrefetchSource, run_load
from .progress import make_progress
from .quiet import wait_quiet
from .stream import RequestResult
from .workloads import Workload, make_workload

LEVEL_SEED_STRIDE = 1_000_003
WARMUP_SEED_OFFSET = 9_999_991


@dataclass
class SideRun:
    """One endpoint's requests at one level."""

    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    cache_delta: dict[str, float | None] | None = None
    metrics_error: str | None = None


@dataclass
class LevelRun:
    load: LoadConfig
    sides: dict[str, SideRun]
    rounds: list[list[str]] = field(default_factory=list)
    settle_s: float = 0.0     # compare: seconds spent waiting for quiet CPUs between sides (BenchConfig.settle_s)


@dataclass
class BenchOutcome:
    config: BenchConfig
    models: dict[str, str]
    levels: list[LevelRun]
    calibration: dict[str, Any] | None = None


class Bench:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.clients: dict[str, ChatClient] = {}
        self.metrics_session: aiohttp.ClientSession | None = None

    async def run(self) -> BenchOutcome:
        cfg = self.config
        sessions = {ep.label: new_session(cfg.load.timeout_s, cfg.api_key, ep.new_connection_per_request)
                    for ep in cfg.endpoints}
        try:
            async with aiohttp.ClientSession() as metrics_session:
                self.metrics_session = metrics_session
                for ep in cfg.endpoints:
                    model = ep.model or await first_model(sessions[ep.label], ep.url)
                    self.clients[ep.label] = ChatClient(sessions[ep.label], ep.url, model, ep.extra_body)
                calibration = await self._calibrate() if cfg.calibrate else None
                await self._warmup()
                levels = [await self._run_level(i, load) for i, load in enumerate(self._level_loads())]
        finally:
            await asyncio.gather(*(s.close() for s in sessions.values()))
        models = {label: c.model for label, c in self.clients.items()}
        return BenchOutcome(cfg, models, levels, calibration)

    def _level_loads(self) -> list[LoadConfig]:
        load = self.config.load
        return [replace(load, concurrency=c) for c in self.config.sweep] or [load]

    async def _calibrate(self) -> dict[str, Any]:
        cfg = self.config
        concurrency = max(cfg.sweep) if cfg.sweep else (cfg.load.concurrency or 1)
        return await calibrate(cfg.workload, concurrency, cfg.load.timeout_s)

    async def _warmup(self) -> None:
        load = self.config.load
        if not load.warmup:
            return
        workload = make_workload(self.config.workload, WARMUP_SEED_OFFSET)
        requests = await asyncio.to_thread(workload.build_many, 0, load.warmup)
        warm = LoadConfig(concurrency=min(load.warmup, load.concurrency or 4), num_requests=load.warmup,
                          timeout_s=load.timeout_s)
        for client in self.clients.values():
            await run_load(client.send, ListSource(requests), warm, arrival_seed=load.seed)

    async def _run_level(self, index: int, load: LoadConfig) -> LevelRun:
        workload = make_workload(self.config.workload, index * LEVEL_SEED_STRIDE)
        if self.config.is_compare:
            return await self._run_compare(workload, load)
        return await self._run_single(workload, load)

    async def _run_single(self, workload: Workload, load: LoadConfig) -> LevelRun:
        ep = self.config.endpoints[0]
        source = PrefetchSource(workload, load.num_requests, _lookahead(load))
        progress = make_progress(self.config.show_progress, load.num_requests, _desc(load, ep.label))
        try:
            await source.prime()
            side = SideRun()
            await self._measured(ep, side, load, source, load.seed, progress)
        finally:
            source.close()
            progress.close()
        return LevelRun(load, {ep.label: side})

    async def _run_compare(self, workload: Workload, load: LoadConfig) -> LevelRun:
        labels = [ep.label for ep in self.config.endpoints]
        sides = {label: SideRun() for label in labels}
        level = LevelRun(load, sides)
        size = self.config.round_size or _auto_round_size(load)
        total = 2 * load.num_requests if load.num_requests else None
        progress = make_progress(self.config.show_progress, total, _desc(load, "A|B"))
        try:
            while not self._is_level_done(level, size):
                start = len(level.rounds) * size
                stop = start + size if load.num_requests is None else min(start + size, load.num_requests)
                requests = await asyncio.to_thread(workload.build_many, start, stop)
                order = labels if len(level.rounds) % 2 == 0 else labels[::-1]
                round_load = replace(load, num_requests=len(requests), duration_s=None)
                for label in order:
                    ep = next(e for e in self.config.endpoints if e.label == label)
                    seed = load.seed + len(level.rounds)
                    if self.config.settle_s:   # the other side's leftover CPU work is not this side's
                        level.settle_s += await wait_quiet(self.config.settle_s)
                    await self._measured(ep, sides[label], round_load, ListSource(requests), seed, progress)
                level.rounds.append(order)
        finally:
            progress.close()
        return level

    def _is_level_done(self, level: LevelRun, size: int) -> bool:
        load = level.load
        if load.num_requests is not None and len(level.rounds) * size >= load.num_requests:
            return True
        return load.duration_s is not None and all(s.duration_s >= load.duration_s for s in level.sides.values())

    async def _measured(self, ep: Endpoint, side: SideRun, load: LoadConfig, source: Any, seed: int,
                        progress: Any) -> None:
        before = await self._counters(ep, side)
        run = await run_load(self.clients[ep.label].send, source, load, seed, progress)
        after = await self._counters(ep, side)
        side.results.extend(run.results)
        side.duration_s += run.duration_s
        if before is not None and after is not None:
            step = prom.delta(before, after)
            side.cache_delta = step if side.cache_delta is None else prom.add_deltas(side.cache_delta, step)

    async def _counters(self, ep: Endpoint, side: SideRun) -> dict[str, float | None] | None:
        if not ep.metrics_urls or side.metrics_error or self.metrics_session is None:
            return None
        try:
            return prom.counters(await prom.scrape(self.metrics_session, ep.metrics_urls))
        except (TimeoutError, aiohttp.ClientError) as exc:
            side.metrics_error = f"cannot scrape {', '.join(ep.metrics_urls)}: {exc!r}"
            side.cache_delta = None
            return None


def _lookahead(load: LoadConfig) -> int:
    rate = load.request_rate if math.isfinite(load.request_rate) else 0.0
    return int(max(64, 8 * (load.concurrency or 1), 4 * rate))


def _auto_round_size(load: LoadConfig) -> int:
    """Rounds long enough that the drain at each round's end is a small part of it."""
    rate = load.request_rate if math.isfinite(load.request_rate) else 0.0
    return int(max(16, 8 * (load.concurrency or 1), 10 * rate))


def _desc(load: LoadConfig, label: str) -> str:
    how = f"rate {load.request_rate:g}/s" if load.is_open_loop else f"concurrency {load.max_in_flight}"
    return f"bench {label} ({how})"


def run_bench(config: BenchConfig) -> BenchOutcome:
    """Run a whole benchmark synchronously (the CLI's and scripts' entry point)."""
    return asyncio.run(Bench(config).run())
