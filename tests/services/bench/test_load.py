"""Arrival process statistics (seeded) and the load modes against the real fake server."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from services.bench.load import arrival_intervals
from tests.services.bench.conftest import bench, summary


def _intervals(rate, burstiness, n=20000, seed=1):
    return np.fromiter(itertools.islice(arrival_intervals(rate, burstiness, seed), n), float)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(burstiness):
    gaps = _intervals(20.0, burstiness)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_burstiness_one_is_poisson():
    arrivals = np.cumsum(_intervals(50.0, 1.0))
    counts = np.bincount(arrivals.astype(int))[:-1]  # arrivals per whole second
    assert counts.mean() == pytest.approx(50.0, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.3)  # dispersion index of a Poisson process
    gaps = _intervals(50.0, 1.0)
    assert np.mean(gaps > 0.02) == pytest.approx(math.exp(-1), abs=0.02)  # exponential tail


def test_arrivals_are_seeded_and_inf_rate_sends_at_once():
    first = list(itertools.islice(arrival_intervals(5, 1, 7), 5))
    assert first == list(itertools.islice(arrival_intervals(5, 1, 7), 5)) and len(set(first)) == 5
    assert list(itertools.islice(arrival_intervals(math.inf, 1, 7), 3)) == [0.0, 0.0, 0.0]


def test_open_loop_run_follows_the_seeded_schedule(fake):
    server = fake()
    _, doc = bench([server.url], num_requests=40, request_rate=80.0, seed=5)
    expected = sum(itertools.islice(arrival_intervals(80.0, 1.0, 5), 39))
    s = summary(doc)
    assert s["completed"] == 40
    assert expected < s["duration_s"] < expected + 0.25


def test_concurrency_caps_in_flight(fake):
    closed, capped = fake("ttft=0.03"), fake("ttft=0.03")
    bench([closed.url], num_requests=12, concurrency=3)
    bench([capped.url], num_requests=12, request_rate=1000.0, concurrency=2)
    assert closed.stats()["max_in_flight"] == 3
    assert capped.stats()["max_in_flight"] == 2


def test_duration_stops_issuing(fake):
    server = fake("ttft=0.02")
    _, doc = bench([server.url], num_requests=None, duration_s=0.3, concurrency=2)
    s = summary(doc)
    assert 0.3 <= s["duration_s"] < 0.45
    assert 8 <= s["completed"] <= 32 and s["completed"] == server.stats()["requests"]


def test_warmup_is_sent_but_not_counted(fake):
    server = fake()
    _, doc = bench([server.url], num_requests=5, warmup=3, concurrency=2)
    assert summary(doc)["completed"] == 5 and server.stats()["requests"] == 8
