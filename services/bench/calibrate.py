"""The client's own floor: the same load against a null server (fakeserver, no delays).

Whatever TTFT, E2E latency and request rate the client reaches against a
server that answers instantly is overhead of the client, the loopback and
aiohttp on this machine; subtracting it from a real run's figures bounds how
much of them the server under test is responsible for.
"""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from types import TracebackType
from typing import Any

from .client import ChatClient, new_session
from .config import BenchError, LoadConfig, Slo, WorkloadConfig
from .load import ListSource, run_load
from .metrics import summarize
from .workloads import make_workload

CALIBRATION_REQUESTS = 200
_SEED_OFFSET = 7_000_003
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeServerProcess:
    """`python -m services.bench.fakeserver` on a free loopback port, as a context manager."""

    def __init__(self, spec: str = "", start_timeout_s: float = 30.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> FakeServerProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.bench.fakeserver", "--port", "0", "--spec", self.spec],
            stdout=subprocess.PIPE, env=env)
        assert self.process.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if ready:
                line = self.process.stdout.readline().decode()
                if line.startswith("listening on "):
                    self.url = line.split()[-1]
                    return self
            if self.process.poll() is not None:
                break
        self.stop()
        raise BenchError("the calibration server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    def __enter__(self) -> FakeServerProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


async def calibrate(workload: WorkloadConfig, concurrency: int, timeout_s: float) -> dict[str, Any]:
    """Closed loop at `concurrency`, the run's own workload, against a null server."""
    count = CALIBRATION_REQUESTS
    requests = await asyncio.to_thread(make_workload(workload, _SEED_OFFSET).build_many, 0, count)
    load = LoadConfig(concurrency=concurrency, num_requests=count, timeout_s=timeout_s)
    with FakeServerProcess("record=0") as server:
        async with new_session(timeout_s) as session:
            client = ChatClient(session, server.url, "calibration")
            run = await run_load(client.send, ListSource(requests), load, arrival_seed=0)
    summary = summarize(run.results, run.duration_s, Slo())
    pick = ("mean", "p50", "p99")
    return {"server": "null (services.bench.fakeserver, no delays)", "requests": count,
            "concurrency": concurrency, "failed": summary["failed"],
            "request_throughput": summary["request_throughput"],
            **{k: {p: summary[k][p] for p in pick} for k in ("ttft_ms", "itl_ms", "e2el_ms")},
            "client": summary["client"]}
