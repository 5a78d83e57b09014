"""The capacity tracker: calls in flight per role, averaged over the window, turned into instances and the E:P:D
ratio as docs/capacity.md's model does (load / ρ; decode rows / (ρ · slots))."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from coordinator.capacity import UTILISATION, CapacityTracker
from coordinator.metrics import CoordinatorMetrics


@dataclass
class FakeInstance:
    inflight: int = 0
    is_healthy: bool = True


@dataclass
class FakePool:
    instances: list[FakeInstance] = field(default_factory=lambda: [FakeInstance(), FakeInstance()])

    def healthy(self) -> list[FakeInstance]:
        return [i for i in self.instances if i.is_healthy]


def test_no_load_recommends_nothing():
    tracker = CapacityTracker({r: FakePool() for r in ("encode", "prefill", "decode")}, decode_slots=16)
    tracker.sample(now=0.0)
    plan = tracker.plan()
    assert plan["recommended_instances"] == {"encode": 0.0, "prefill": 0.0, "decode": 0.0}
    assert plan["ratio_text"] == "no load yet" and plan["instances"] == {"encode": 2, "prefill": 2, "decode": 2}


def test_the_averages_over_the_window_become_instances_and_the_ratio():
    pools = {r: FakePool() for r in ("encode", "prefill", "decode")}
    metrics = CoordinatorMetrics(CollectorRegistry())
    tracker = CapacityTracker(pools, decode_slots=8, metrics=metrics, window_s=10.0)
    for t in range(20):   # the first half drops out of the 10 s window
        late = t >= 10
        pools["encode"].instances[0].inflight = 2 if late else 50      # 2 items in flight on one, 1 on the other
        pools["encode"].instances[1].inflight = 1
        pools["prefill"].instances[0].inflight = t % 2 if late else 9    # 0.5 on average
        pools["decode"].instances[0].inflight = 14 if late else 0       # 14 + 14 rows
        pools["decode"].instances[1].inflight = 14
        tracker.sample(now=float(t))
    plan = tracker.plan()
    assert plan["load"] == {"encode": 3.0, "prefill": 0.5, "decode": 28.0}
    assert plan["recommended_instances"] == pytest.approx(
        {"encode": 3.0 / UTILISATION, "prefill": 0.5 / UTILISATION, "decode": 28.0 / (UTILISATION * 8)}, abs=1e-3)
    assert plan["ratio"] == {"encode": 6.0, "prefill": 1.0, "decode": 7.0} and plan["ratio_text"] == "6.0:1.0:7.0"
    assert plan["window_s"] == 9.0
    assert metrics.recommended_ratio.labels("decode")._value.get() == 7.0
    assert metrics.recommended_instances.labels("prefill")._value.get() == pytest.approx(0.5 / UTILISATION, abs=1e-3)
