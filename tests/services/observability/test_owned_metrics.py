"""Gauges owned by the object they measure: each owner's value, gone with the owner."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest

from services.observability.owned_metrics import OwnedGauges


class Store:
    def __init__(self, held: int) -> None:
        self.held = held


def _value(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("epd_test_bytes")


def test_the_gauge_reads_its_own_owner_at_scrape_time_and_leaves_with_it():
    registry = CollectorRegistry()
    store = Store(10)
    OwnedGauges(store, {"epd_test_bytes": ("bytes held", lambda s: s.held)}, registry)
    assert _value(registry) == 10
    store.held = 25
    assert _value(registry) == 25
    del store
    gc.collect()
    assert _value(registry) is None and b"epd_test_bytes" not in generate_latest(registry)


def test_a_failing_read_scrapes_as_zero():
    registry = CollectorRegistry()
    store = Store(1)
    OwnedGauges(store, {"epd_test_bytes": ("bytes held", lambda s: 1 / 0)}, registry)
    assert _value(registry) == 0.0
