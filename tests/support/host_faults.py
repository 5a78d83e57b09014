"""Streaming load and the coordinator's view of instances, for host-fault scenarios (tests/e2e/multihost and
benchmarks/multihost_faults.py share them).

`StreamLoad` keeps `workers` greedy chat streams running, each with one image and a client `uuid` never used
before, so every request is encoded (a uuid names the item: docs/security.md) while its answer stays the one
its prompt always gets; `expected_texts` are those answers from an undisturbed pass.  A request is *lost*
when it does not end with HTTP 200, no in-stream error, finish "length" and exactly the expected text.
`seen_down` and `serving_again` poll the coordinator's /metrics every 20 ms.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.cluster import metric_value
from tests.support.images import data_url, noise_image

POLL_S = 0.02


def prompt(index: int, max_tokens: int, tag: str | None = None) -> dict[str, Any]:
    """Prompt `index`: one image (its own pixels) with the client uuid `tag` (fresh when None), greedy."""
    part = {"type": "image_url", "image_url": {"url": data_url(noise_image(64, 48 + 8 * (index % 4), 900 + index))},
            "uuid": tag or uuid.uuid4().hex}
    return {"messages": [{"role": "user", "content": [part, {"type": "text",
                                                               "text": f"Picture {index}: what is in it?"}]}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


@dataclass
class StreamResult:
    index: int
    started: float
    status: int = 0
    text: str = ""
    finish: str | None = None
    error: str = ""

    def lost(self, expected: str) -> bool:
        return self.status != 200 or bool(self.error) or self.finish != "length" or self.text != expected


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], index: int) -> StreamResult:
    result = StreamResult(index, time.monotonic())
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as reply:
            result.status = reply.status
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = json.dumps(event["error"])[:300]
                for choice in event.get("choices") or ():
                    result.text += (choice.get("delta") or {}).get("content") or ""
                    result.finish = choice.get("finish_reason") or result.finish
            if reply.status != 200 and not result.error:
                result.error = f"HTTP {reply.status}"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def expected_texts(url: str, count: int, max_tokens: int) -> list[str]:
    """The undisturbed answer of each prompt (streamed, one at a time)."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = [await stream_one(session, url, prompt(i, max_tokens), i) for i in range(count)]
    bad = [r for r in results if r.status != 200 or r.error or r.finish != "length"]
    if bad:
        raise RuntimeError(f"the undisturbed pass failed: {bad[:3]}")
    return [r.text for r in results]


@dataclass
class StreamLoad:
    """`workers` streams at a time over `count` prompts (round robin) until `stop()`; results as they end."""

    url: str
    count: int
    max_tokens: int
    workers: int
    results: list[StreamResult] = field(default_factory=list)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> None:
        order = itertools.count()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))

        async def worker() -> None:
            while not self._stopping.is_set():
                index = next(order) % self.count
                self.results.append(await stream_one(session, self.url, prompt(index, self.max_tokens), index))

        async def run() -> None:
            try:
                await asyncio.gather(*(worker() for _ in range(self.workers)))
            finally:
                await session.close()

        self._tasks.append(asyncio.create_task(run()))

    async def stop(self, timeout: float = 120.0) -> list[StreamResult]:
        """Let the streams running now end (bounded), start no more; every result."""
        self._stopping.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout)
        return self.results


def lost(results: list[StreamResult], expected: list[str]) -> list[StreamResult]:
    return [r for r in results if r.lost(expected[r.index])]


async def metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as reply:
        return await reply.text()


def healthy(text: str, address: str) -> float | None:
    """1 or 0 while the coordinator knows `address`, None once it forgot it."""
    label = f'instance="{address}"'
    if not any(line.startswith("epd_coordinator_instance_healthy") and label in line for line in text.splitlines()):
        return None
    return metric_value(text, "epd_coordinator_instance_healthy", label)


def served(text: str, address: str) -> float:
    return metric_value(text, "epd_coordinator_instance_calls_total", f'instance="{address}",result="ok"')


async def counters(url: str) -> dict[str, float]:
    """The coordinator's count of resumed decode streams and of encode calls that failed over."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        text = await metrics(session, url)
    return {"resumed_streams": metric_value(text, "epd_coordinator_resumed_streams_total"),
            "encode_failovers": metric_value(text, "epd_coordinator_failovers_total", 'role="encode"')}


async def seen_down(url: str, address: str, since: float, timeout: float = 10.0) -> float:
    """Seconds from `since` until the coordinator reports `address` unhealthy (or forgot it); inf if never."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() - since < timeout:
            if healthy(await metrics(session, url), address) != 1:
                return time.monotonic() - since
            await asyncio.sleep(POLL_S)
    return float("inf")


async def serving_again(url: str, address: str, since: float, timeout: float = 20.0) -> tuple[float, float]:
    """Seconds from `since` until `address` is healthy again, and until it has served a call since; inf if never."""
    back = float("inf")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        before = served(await metrics(session, url), address)
        while time.monotonic() - since < timeout:
            text = await metrics(session, url)
            if healthy(text, address) is None:
                before = 0.0   # forgotten: its counters start again from zero when it rejoins
            if back == float("inf") and healthy(text, address) == 1:
                back = time.monotonic() - since
            if back != float("inf") and served(text, address) > before:
                return back, time.monotonic() - since
            await asyncio.sleep(POLL_S)
    return back, float("inf")


# ---- scenarios (tests/e2e/multihost/test_host_faults.py asserts them; benchmarks/multihost_faults.py reports them)


async def ready_flip(url: str, ready: bool, since: float, timeout: float = 20.0) -> float:
    """Seconds from `since` until GET `url`/ready answers 200 (`ready`) or not; inf if it never does."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() - since < timeout:
            try:
                async with session.get(url + "/ready") as reply:
                    if (reply.status == 200) == ready:
                        return time.monotonic() - since
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(POLL_S)
    return float("inf")


async def cut_and_restore(cluster: Any, hosts: tuple[str, ...] = ("decode0", "encode0"), count: int = 8,
                          max_tokens: int = 24, workers: int = 6, cut_for_s: float = 4.0) -> dict[str, Any]:
    """Under streaming load, take `hosts` off the network at once, bring them back after `cut_for_s`: requests
    lost, when each was seen down, when each was healthy again and had served a call again."""
    expected = await expected_texts(cluster.url, count, max_tokens)
    before = await counters(cluster.url)
    load = StreamLoad(cluster.url, count, max_tokens, workers)
    load.start()
    await asyncio.sleep(2.0)   # every worker mid-stream
    addresses = [cluster.grpc_address(h) for h in hosts]
    cut = cluster.hosts.cut(hosts[0])
    for host in hosts[1:]:
        cluster.hosts.cut(host)
    seen = await asyncio.gather(*(seen_down(cluster.url, a, cut) for a in addresses))
    await asyncio.sleep(max(0.0, cut + cut_for_s - time.monotonic()))
    restored = cluster.hosts.restore(hosts[0])
    for host in hosts[1:]:
        cluster.hosts.restore(host)
    back = await asyncio.gather(*(serving_again(cluster.url, a, restored) for a in addresses))
    results = await load.stop()
    after = await counters(cluster.url)
    return {"hosts": list(hosts), "requests": len(results), "lost": len(lost(results, expected)),
            **{name: after[name] - before[name] for name in after},
            "lost_examples": [vars(r) for r in lost(results, expected)[:3]], "cut_for_s": cut_for_s,
            "seen_down_s": dict(zip(hosts, seen, strict=True)),
            "healthy_again_s": {h: b[0] for h, b in zip(hosts, back, strict=True)},
            "serving_again_s": {h: b[1] for h, b in zip(hosts, back, strict=True)}}


async def redis_restart(cluster: Any, away_s: float = 3.5, count: int = 8, max_tokens: int = 24,
                        workers: int = 6) -> dict[str, Any]:
    """Under streaming load, Redis is killed and started again (empty) `away_s` later: requests lost, when the
    roles and the coordinator turned not ready and when ready again."""
    expected = await expected_texts(cluster.url, count, max_tokens)
    load = StreamLoad(cluster.url, count, max_tokens, workers)
    load.start()
    await asyncio.sleep(2.0)
    urls = {h: cluster.http_url(h) for h in ("encode0", "prefill", "decode0")} | {"coordinator": cluster.url}
    killed = cluster.kill("redis")
    not_ready = await asyncio.gather(*(ready_flip(u, False, killed) for u in urls.values()))
    await asyncio.sleep(max(0.0, killed + away_s - time.monotonic()))
    cluster.start_redis()
    started = time.monotonic()
    ready = await asyncio.gather(*(ready_flip(u, True, started) for u in urls.values()))
    await asyncio.sleep(2.0)   # requests made after it is back, too
    results = await load.stop()
    return {"requests": len(results), "lost": len(lost(results, expected)),
            "lost_examples": [vars(r) for r in lost(results, expected)[:3]], "away_s": away_s,
            "not_ready_after_s": dict(zip(urls, not_ready, strict=True)),
            "ready_again_after_s": dict(zip(urls, ready, strict=True))}


async def partition(cluster: Any, a: str = "prefill", b: str = "decode0", requests: int = 12,
                    max_tokens: int = 8) -> dict[str, Any]:
    """`a` and `b` cannot reach each other (both reach everything else): requests lost, and how many `b` served
    meanwhile (prefill's KV reaches it through Redis, never directly)."""
    expected = await expected_texts(cluster.url, requests, max_tokens)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        before = served(await metrics(session, cluster.url), cluster.grpc_address(b))
    cluster.hosts.partition(a, b)
    try:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            results = await asyncio.gather(*(stream_one(session, cluster.url, prompt(i, max_tokens), i)
                                              for i in range(requests)))
            after = served(await metrics(session, cluster.url), cluster.grpc_address(b))
    finally:
        cluster.hosts.heal(a, b)
    return {"between": [a, b], "requests": len(results), "lost": len(lost(list(results), expected)),
            "served_by_" + b: after - before}
