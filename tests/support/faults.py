"""Fault-injection helpers for end-to-end tests: find and kill role processes, load, metrics, SSE streams.

Role processes are children of `epd serve`; an instance is identified by the
gRPC port in its environment (EPD_GRPC_PORT), which is what the ready line
and the coordinator's metrics name.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from tests.support.cluster import RunningCluster, metric_value


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    except OSError:
        return {}
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def grpc_address(cluster: RunningCluster, role: str, index: int) -> str:
    return [g for r, _, g in cluster.roles if r == role][index]


def role_pid(cluster: RunningCluster, role: str, index: int) -> int:
    port = grpc_address(cluster, role, index).rsplit(":", 1)[1]
    for pid in _children(cluster.process.pid):
        if _environ(pid).get("EPD_GRPC_PORT") == port:
            return pid
    raise LookupError(f"no process for {role}[{index}] (grpc port {port})")


def kill9(cluster: RunningCluster, role: str, index: int) -> float:
    """SIGKILL one role instance; returns the monotonic time of the kill."""
    os.kill(role_pid(cluster, role, index), signal.SIGKILL)
    return time.monotonic()


def coordinator_metrics(cluster: RunningCluster) -> str:
    return httpx.get(cluster.url + "/metrics", timeout=10).text


def calls(text: str, address: str, result: str) -> float:
    return metric_value(text, "epd_coordinator_instance_calls_total", f'instance="{address}",result="{result}"')


async def wait_marked_down(url: str, address: str, timeout: float = 5.0) -> float:
    """Seconds until the coordinator reports the instance unhealthy (polled every 20 ms)."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - started < timeout:
            async with session.get(url + "/metrics") as reply:
                text = await reply.text()
            if metric_value(text, "epd_coordinator_instance_healthy", f'instance="{address}"') == 0 \
                    and f'instance="{address}"' in text:
                return time.monotonic() - started
            await asyncio.sleep(0.02)
    return float("inf")


@dataclass
class Outcome:
    index: int
    status: int = 0
    seconds: float = 0.0
    body: Any = None
    error: str = ""


@dataclass
class LoadRun:
    """Bodies posted with bounded concurrency; `hooks[k]` starts (as a task) once k requests are done."""

    url: str
    bodies: list[dict]
    concurrency: int
    hooks: dict[int, Callable[[], Awaitable[Any]]] = field(default_factory=dict)
    hook_results: dict[int, Any] = field(default_factory=dict)
    path: str = "/v1/chat/completions"
    timeout_s: float = 60.0
    pace_s: float = 0.0    # each worker waits at least this long between the starts of its requests

    async def _one(self, session: aiohttp.ClientSession, index: int) -> Outcome:
        outcome, started = Outcome(index), time.monotonic()
        try:
            async with session.post(self.url + self.path, json=self.bodies[index]) as reply:
                outcome.status = reply.status
                outcome.body = await reply.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.seconds = time.monotonic() - started
        return outcome

    async def run(self) -> list[Outcome]:
        pending = iter(range(len(self.bodies)))
        results: list[Outcome] = []
        tasks: dict[int, asyncio.Task] = {}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def worker() -> None:
                for index in pending:
                    started = time.monotonic()
                    results.append(await self._one(session, index))
                    hook = self.hooks.get(len(results))
                    if hook is not None:
                        tasks[len(results)] = asyncio.create_task(hook())
                    await asyncio.sleep(max(0.0, self.pace_s - (time.monotonic() - started)))
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
            for done, task in tasks.items():
                self.hook_results[done] = await task
        return sorted(results, key=lambda o: o.index)


@dataclass
class StreamLog:
    """One SSE stream: (arrival time, parsed event) pairs, and how it ended."""

    events: list[tuple[float, Any]] = field(default_factory=list)
    status: int = 0
    error: str = ""

    def tokens(self) -> int:
        return sum(1 for _, e in self.events if isinstance(e, dict) and e.get("choices")
                   and e["choices"][0].get("delta", {}).get("content"))

    def error_event(self) -> tuple[float, dict] | None:
        return next(((t, e) for t, e in self.events if isinstance(e, dict) and "error" in e), None)

    def finish_reason(self) -> str | None:
        reasons = [e["choices"][0].get("finish_reason") for _, e in self.events
                   if isinstance(e, dict) and e.get("choices")]
        return next((r for r in reversed(reasons) if r), None)


async def stream_chat(url: str, body: dict, log: StreamLog, timeout_s: float = 60.0,
                      headers: dict[str, str] | None = None) -> StreamLog:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, \
            session.post(url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as reply:
        log.status = reply.status
        async for raw in reply.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line[6:]
                log.events.append((time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)))
    return log
