"""Gauges (and owner-kept counters: names ending in _total) owned by the object they measure, read at scrape
time.

A role's core (EncodeService, PrefillService, DecodeService) builds one
`OwnedGauges` over itself at construction: each gauge is a function of the
owner, evaluated on every scrape, so evictions, expiry and freed slots show
at once.  The collector holds the owner weakly: once the owner is gone its
series disappear (instead of a module-level gauge rebound to whichever
object was built last, which is what several roles did before).  A reader
must not block: it reads counters, never takes a data-path lock (see the
stores' `stats()`).

The collector claims no names at registration (describe() is empty), so a
test process that builds several owners does not fail to register; a role
process builds one.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

O = TypeVar("O")  # noqa: E741 - the owner type
Read = Callable[[Any], float]


class OwnedCollector(ABC):
    """A collector read from `owner` at scrape time, holding it weakly: unregistered once the owner is gone."""

    def __init__(self, owner: Any, registry: CollectorRegistry = REGISTRY) -> None:
        self._owner = weakref.ref(owner)
        self._registry = registry
        registry.register(self)
        weakref.finalize(owner, self._unregister)

    def describe(self) -> list[Metric]:
        return []

    @abstractmethod
    def collect(self) -> Iterator[Metric]:
        """The owner's metrics now (nothing once it is gone)."""

    def _unregister(self) -> None:
        with contextlib.suppress(KeyError):
            self._registry.unregister(self)


class OwnedGauges(OwnedCollector, Generic[O]):
    def __init__(self, owner: O, gauges: dict[str, tuple[str, Read]],
                 registry: CollectorRegistry = REGISTRY) -> None:
        self._gauges = gauges
        super().__init__(owner, registry)

    def collect(self) -> Iterator[Metric]:
        owner = self._owner()
        if owner is None:
            return
        for name, (doc, read) in self._gauges.items():
            if name.endswith("_total"):  # a monotonic count the owner keeps (e.g. bytes copied)
                yield CounterMetricFamily(name.removesuffix("_total"), doc, value=read_safely(read, owner))
            else:
                yield GaugeMetricFamily(name, doc, value=read_safely(read, owner))


def read_safely(read: Read, owner: Any) -> float:
    try:
        return float(read(owner))
    except Exception:  # noqa: BLE001 - a scrape must never fail because of what it measures
        return 0.0
