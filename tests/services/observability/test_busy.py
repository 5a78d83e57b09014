"""A role's busy fraction: the share of the last window its engine computed, from the intervals compute_timer
times, capped at 1, exported as epd_role_busy_fraction{role}."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from services.observability.busy import BusyWindow, record
from services.observability.compute_metrics import compute_timer


def test_covered_share_of_the_window():
    window = BusyWindow(window_s=10.0)
    window.add(0.0, 2.0)      # before the window at now=15: dropped
    window.add(4.0, 7.0)      # 2 s of it inside [5, 15]
    window.add(9.0, 12.0)     # 3 s
    assert window.fraction(now=15.0) == pytest.approx(0.5)
    window.add(12.0, 40.0)
    assert window.fraction(now=30.0) == 1.0   # computing the whole window: capped, never above 1


def test_compute_timer_feeds_the_roles_gauge():
    with compute_timer("decode_step"):
        time.sleep(0.05)
    value = REGISTRY.get_sample_value("epd_role_busy_fraction", {"role": "decode"})
    assert value is not None and 0.04 / 30 <= value <= 1.0
    record("not_a_stage", 0.0, 1.0)   # no role: ignored
    assert REGISTRY.get_sample_value("epd_role_busy_fraction", {"role": "not_a_stage"}) is None
