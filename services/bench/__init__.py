"""`epd bench`: a load generator for any OpenAI-compatible chat endpoint.

Flow: cli (flags) -> config (frozen BenchConfig) -> runner.Bench, which per
level builds requests (workloads, images), issues them (load) through the
streaming client (client, sse, stream), reads the cluster's counters (prom)
and hands raw results to report (JSON, via metrics and compare), tables
(text) and plots (PNG). fakeserver is a scripted OpenAI server used for
--calibrate and by the tests. Scripts use `run_bench(BenchConfig(...))` and
`report.to_json(outcome)`.
"""

from __future__ import annotations

from .config import BenchConfig, BenchError, Endpoint, LoadConfig, Slo, WorkloadConfig
from .runner import BenchOutcome, run_bench

__all__ = ["BenchConfig", "BenchError", "BenchOutcome", "Endpoint", "LoadConfig", "Slo", "WorkloadConfig",
           "run_bench"]
