"""Every process runs on the event loop `--event-loop` names: uvloop by default, the standard library's on request.

Read from each process's own `epd_event_loop_info{loop}` (set from the loop it is running on, not from the flag).
The secure cluster runs with `--event-loop asyncio`, so its whole suite (TLS, keys, answers, errors) checks that
loop; every other cluster checks uvloop.
"""

from __future__ import annotations

import httpx
import pytest

from services.runtime import event_loop
from tests.support.cluster import metric_value

ROLES = ("render", "encode", "prefill", "decode")


def _loops(cluster) -> dict[str, dict[str, float]]:
    texts = {"coordinator": httpx.get(cluster.url + "/metrics", timeout=10).text,
             **{role: cluster.metrics(role) for role in ROLES}}
    return {name: {loop: metric_value(text, "epd_event_loop_info", f'loop="{loop}"') for loop in event_loop.LOOPS}
            for name, text in texts.items()}


def test_every_process_runs_uvloop_by_default(shm_cluster):
    assert _loops(shm_cluster) == {name: {"uvloop": 1.0, "asyncio": 0.0} for name in ("coordinator", *ROLES)}


def test_event_loop_asyncio_runs_every_process_on_the_standard_loop(secure_cluster):
    assert _loops(secure_cluster) == {name: {"uvloop": 0.0, "asyncio": 1.0} for name in ("coordinator", *ROLES)}


def test_run_reports_the_loop_it_ran_and_refuses_an_unknown_one():
    async def kind() -> str:
        return event_loop.running_kind()

    assert event_loop.run(kind(), "uvloop") == "uvloop"
    assert event_loop.run(kind(), "asyncio") == "asyncio"
    with pytest.raises(ValueError, match="event loop must be one of uvloop, asyncio, not 'trio'"):
        event_loop.run(kind(), "trio")


def test_config_takes_the_loops_run_knows():
    from services.config import EVENT_LOOPS, ConfigError, EpdConfig

    assert event_loop.LOOPS is EVENT_LOOPS and EpdConfig().server.event_loop == "uvloop"
    with pytest.raises(ConfigError, match="event_loop must be one of uvloop, asyncio"):
        EpdConfig.of(event_loop="trio")
