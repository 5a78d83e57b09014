"""vLLM's load gauges over a role core, exposed through a private registry: names, labels and each role's formula.

The owners are stand-ins with the attributes the reads use (the e2e test scrapes real roles); the
formulas are what llm-d's scheduler sees, so each is checked with numbers that tell them apart.
"""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from services.observability.vllm_metrics import VllmGauges


class NS(SimpleNamespace):
    """A stand-in owner (weakly referenceable, as a role core is)."""


def _exposed(owner, role: str) -> str:
    registry = CollectorRegistry()
    VllmGauges(owner, role, "m1", registry)
    return generate_latest(registry).decode()


def _lines(running: float, waiting: float, usage: float) -> list[str]:
    return [f'vllm:num_requests_running{{engine="0",model_name="m1"}} {running}',
            f'vllm:num_requests_waiting{{engine="0",model_name="m1"}} {waiting}',
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m1"}} {usage}']


def test_decode_counts_rows_queued_and_kv_waiters_and_reserved_blocks():
    stats = NS(active=3, queued=2, kv=NS(used_blocks=10, reserved_blocks=6, num_blocks=64))
    owner = NS(engine=NS(stats=lambda: stats), num_waiting_for_kv=1)
    text = _exposed(owner, "decode")
    assert [line for line in text.splitlines() if line.startswith("vllm:")] == _lines(3.0, 3.0, 0.25)
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in text
    assert "# HELP vllm:num_requests_waiting Number of requests waiting to be processed." in text


def test_prefill_counts_free_and_cached_blocks_as_free():
    owner = NS(engine=NS(num_running=2, blocks=NS(num_free=48, num_blocks=64)), admission=NS(inside=5))
    text = _exposed(owner, "prefill")
    assert [line for line in text.splitlines() if line.startswith("vllm:")] == _lines(2.0, 3.0, 0.25)


def test_encode_splits_admitted_items_by_the_tower_queue():
    owner = NS(engine=NS(num_pending=4), admission=NS(inside=7))
    text = _exposed(owner, "encode")
    assert [line for line in text.splitlines() if line.startswith("vllm:")] == _lines(3.0, 4.0, 0.0)
