"""A real scripted OpenAI server (services.bench.fakeserver) in its own process, and a helper
that runs a benchmark against one of its behaviours."""

from __future__ import annotations

import itertools
import json
import urllib.request
from typing import Any

import pytest

from services.bench import BenchConfig, Endpoint, LoadConfig, Slo, WorkloadConfig, run_bench
from services.bench.calibrate import FakeServerProcess
from services.bench.report import to_json

_TAGS = itertools.count()


@pytest.fixture(scope="session")
def fake_server():
    with FakeServerProcess() as server:
        yield server.url


class Fake:
    """One behaviour of the fake server, with its own counters (a unique tag)."""

    def __init__(self, base: str, spec: str) -> None:
        self.spec = f"{spec},tag={next(_TAGS)}".lstrip(",")
        self.url = f"{base}/fake/{self.spec}"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as resp:
            return json.load(resp)


@pytest.fixture
def fake(fake_server):
    return lambda spec="": Fake(fake_server, spec)


def text_workload(**kw: Any) -> WorkloadConfig:
    return WorkloadConfig(**{"kind": "text", "input_len": 16, "output_len": 8, **kw})


def bench(urls: list[str], workload: WorkloadConfig | None = None, slo: Slo | None = None,
          metrics: tuple[str, ...] = (), **load: Any):
    """Run a benchmark quietly; returns (outcome, JSON document)."""
    endpoints = tuple(Endpoint(u, None, metrics if i == 0 else (), "AB"[i]) for i, u in enumerate(urls))
    config = BenchConfig(endpoints, workload or text_workload(), LoadConfig(**{"num_requests": 8, **load}),
                         slo or Slo(), show_progress=False)
    outcome = run_bench(config)
    return outcome, to_json(outcome)


def summary(doc: dict[str, Any], label: str = "A", level: int = 0) -> dict[str, Any]:
    return doc["levels"][level]["results"][label]
