"""One tiny cluster for the benchmark tests that measure a running epd: started once for the package.

It is what `stage_overlap --quick` and `tpot_under_prefill --quick` would start (same model, flags and activity
log), so their runs measure it through --epd-url; the idle-TTFT and request-trace tests measure it too, instead
of a cluster each (every start costs the suite ~15 s on 2 cores).  No test changes its state: each waits until
it is idle first and counts only what falls inside its own windows.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def tiny_cluster(tmp_path_factory):
    """(server, activity folder)."""
    from benchmarks import stage_overlap, tpot_under_prefill
    from benchmarks.procs import running, start_epd
    from services.models.demo import demo_model_path
    from services.observability.activity import ENV

    assert stage_overlap.QUICK_FLAGS == tpot_under_prefill.QUICK_FLAGS  # what makes one cluster serve both
    assert stage_overlap.Setup.quick().model == tpot_under_prefill.Setup.quick().model == "tiny"
    folder = tmp_path_factory.mktemp("activity")
    with running(start_epd(str(demo_model_path("tiny")), *stage_overlap.QUICK_FLAGS, env={ENV: str(folder)})) \
            as (server,):
        yield server, folder
