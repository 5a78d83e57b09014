"""The capacity tracker: calls in flight per role, averaged over the window, turned into instances and the E:P:D
ratio as docs/capacity.md's model does (load / ρ; decode rows / (ρ · slots))."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from coordinator.capacity import UTILISATION, CapacityTracker
from coordinator.metrics import CoordinatorMetrics


@dataclass
class FakePool:
    """Two healthy instances; `seconds`: the call-seconds so far (InstancePool.call_seconds)."""

    seconds: float = 0.0
    instances: list[str] = field(default_factory=lambda: ["a", "b"])

    def healthy(self) -> list[str]:
        return self.instances

    def call_seconds(self) -> float:
        return self.seconds


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
    for t in range(21):   # the first half drops out of the 10 s window
        late = t > 10
        pools["encode"].seconds += 3.0 if late else 50.0     # 3 items in flight on average
        pools["prefill"].seconds += 0.5 if late else 9.0     # 0.5 prompts
        pools["decode"].seconds += 28.0 if late else 0.0     # 28 rows
        tracker.sample(now=float(t))
    plan = tracker.plan()
    assert plan["load"] == {"encode": 3.0, "prefill": 0.5, "decode": 28.0}
    assert plan["recommended_instances"] == pytest.approx(
        {"encode": 3.0 / UTILISATION, "prefill": 0.5 / UTILISATION, "decode": 28.0 / (UTILISATION * 8)}, abs=1e-3)
    assert plan["ratio"] == {"encode": 6.0, "prefill": 1.0, "decode": 7.0} and plan["ratio_text"] == "6.0:1.0:7.0"
    assert plan["window_s"] == 9.0   # samples 11..20
    assert metrics.recommended_ratio.labels("decode")._value.get() == 7.0
    assert metrics.recommended_instances.labels("prefill")._value.get() == pytest.approx(0.5 / UTILISATION, abs=1e-3)
