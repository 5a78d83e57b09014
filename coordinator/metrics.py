"""Prometheus metrics of the coordinator."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.requests = Counter("epd_coordinator_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"])
        self.stage_seconds = Histogram("epd_coordinator_stage_seconds", "Time spent per pipeline stage",
                                       ["stage"], buckets=_BUCKETS)
        self.ttft_seconds = Histogram("epd_coordinator_ttft_seconds", "Time to first token", buckets=_BUCKETS)
        self.encode_calls = Counter("epd_coordinator_encode_calls", "Encode calls made (one per item)")
        self.ec_known_hits = Counter("epd_coordinator_ec_known_hits",
                                     "Items whose embedding the coordinator knew was stored (not sent)")
        self.failovers = Counter("epd_coordinator_failovers", "Calls retried on another instance")
