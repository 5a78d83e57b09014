"""Per-stage compute time, measured by the roles themselves: `epd_stage_compute_seconds{stage}`.

Stages: "encode" (one vision-tower forward, a batch of items), "prefill" (one packed forward of
the decoder stack: the prompts and chunks the prefill scheduler batched, LM head included) and
"decode_step" (one batched decode forward plus sampling).  Subtracting these from a request's TTFT gives what the
pipeline around the models costs (benchmarks/overhead.py); the sums per forward feed the
capacity model (docs/capacity.md).  The engines observe it, so it is what the model really
took, not what a caller waited for.  Each interval also feeds the role's busy fraction
(services/observability/busy.py), what an autoscaler scales the role on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Histogram

from services.hostcpu import compute_lease
from services.observability import busy
from services.observability.activity import span

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STAGE_COMPUTE_SECONDS = Histogram("epd_stage_compute_seconds", "Model compute per stage, timed inside the role "
                                  "(encode: one vision forward; prefill: one packed forward; decode_step: one batched "
                                  "step)", ["stage"], buckets=_BUCKETS)


@contextmanager
def compute_timer(stage: str) -> Iterator[None]:
    """Observe the block's wall time under `stage` (also when it raises: the time was spent); also a span
    of the opt-in activity log (services/observability/activity.py).  Encode's and prefill's forwards first take the
    compute lease where one is configured (services/hostcpu/compute_lease.py); its wait is not compute."""
    with compute_lease.held(stage) if stage in compute_lease.STAGES else contextlib.nullcontext():
        started = time.perf_counter()
        try:
            with span(stage):
                yield
        finally:
            ended = time.perf_counter()
            STAGE_COMPUTE_SECONDS.labels(stage).observe(ended - started)
            busy.record(stage, started, ended)
