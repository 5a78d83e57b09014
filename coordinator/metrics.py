"""Prometheus metrics of the coordinator.

Names end up as `epd_coordinator_*` (counters get the `_total` suffix on
export).  Together with each role's own metrics (epd_rpc_*, queue depths,
slots, store bytes and entries) they answer: how many requests, which
errors, where the time goes, how full each stage is, how often items come
from a cache, how often calls were retried or failed over.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client import Histogram as _Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        # A registry per instance lets tests build several clusters in one process.
        Counter, Gauge, Histogram = _bound(registry)  # noqa: N806 - the metric classes, bound to `registry`
        self.requests = Counter("epd_coordinator_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"])
        self.errors = Counter("epd_coordinator_errors", "Error answers by endpoint and epd error code",
                              ["endpoint", "code"])
        self.stage_seconds = Histogram("epd_coordinator_stage_seconds", "Time spent per pipeline stage",
                                       ["stage"], buckets=_BUCKETS)
        self.ttft_seconds = Histogram("epd_coordinator_ttft_seconds", "Time to first token", buckets=_BUCKETS)
        self.encode_calls = Counter("epd_coordinator_encode_calls", "Encode calls made (one per item)")
        self.ec_known_hits = Counter("epd_coordinator_ec_known_hits",
                                     "Items whose embedding the coordinator knew was stored (not sent)")
        self.mm_items = Counter("epd_coordinator_mm_items", "Image items by where the embedding came from: "
                                "known (handle remembered here), cache_hit (encoder had it), encoded, "
                                "inline (no encoder could: prefill encoded it)",
                                ["source"])
        self.mm_payload_bytes = Counter(
            "epd_coordinator_mm_payload_bytes", "kwargs_data bytes that crossed the coordinator's gRPC, by hop "
            "(render: received in RenderResponses; encode, prefill: sent). Items by handle carry only their "
            "skeleton (no tensor bytes); the tensors go render -> mm store -> encode", ["hop"])
        self.failovers = Counter("epd_coordinator_failovers",
                                 "Calls retried on another instance after a transport failure", ["role"])
        self.retries = Counter("epd_coordinator_retries", "Stage retries by role and reason "
                               "(overloaded, ec_entry_missing, kv_entry_missing)", ["role", "reason"])
        self.instance_calls = Counter("epd_coordinator_instance_calls", "Calls per instance by result",
                                      ["role", "instance", "result"])
        self.instance_healthy = Gauge("epd_coordinator_instance_healthy", "1 while the instance takes work",
                                      ["role", "instance"])
        self.inflight = Gauge("epd_coordinator_inflight_requests", "Generation requests running now")
        self.rejected = Counter("epd_coordinator_rejected_requests",
                                "Requests refused with 429 before any work, by reason", ["reason"])
        self.resumed = Counter("epd_coordinator_resumed_streams", "Answers whose decode instance failed mid-stream "
                               "and that went on on another one (the prompt and the tokens sent prefilled again)")
        self.weight_version_mixed = Counter(
            "epd_coordinator_weight_version_mixed", "Requests failed because a stage answered with weights other than "
            "the request's (never a mixed answer; 0 is the expected value), by the stage's role", ["role"])
        self.cancelled = Counter("epd_coordinator_cancelled_requests",
                                 "Requests cancelled by reason (disconnect, abort)", ["reason"])
        self.recommended_instances = Gauge(
            "epd_coordinator_recommended_instances", "Instances of the role the capacity model recommends for the "
            "last minute's load at 70% utilisation (coordinator/capacity.py; docs/capacity.md)", ["role"])
        self.recommended_ratio = Gauge("epd_coordinator_recommended_ratio", "The recommended instances of the role "
                                       "over the smallest role's: the E:P:D ratio", ["role"])

    def forget_instance(self, role: str, address: str) -> None:
        """Drop the per-instance series of an instance that left the pool."""
        for result in ("ok", "failed", "refused"):
            _remove(self.instance_calls, role, address, result)
        _remove(self.instance_healthy, role, address)


def _bound(registry: CollectorRegistry) -> tuple[Any, Any, Any]:
    return (functools.partial(_Counter, registry=registry), functools.partial(_Gauge, registry=registry),
            functools.partial(_Histogram, registry=registry))


def _remove(metric: _Counter | _Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)
