"""The scale-out benchmarks' figures on known numbers, and the Redis Cluster bandwidth run at its smallest (their
full runs take minutes: benchmarks/multihost_faults.py needs root and starts eight hosts)."""

from __future__ import annotations

import pytest

from benchmarks import multihost_faults, redis_cluster


def _round(lost: int, seen: float, back: float) -> dict:
    return {"requests": 10, "lost": lost, "resumed_streams": 2, "encode_failovers": 1,
            "seen_down_s": {"decode0": seen, "encode0": seen / 2},
            "serving_again_s": {"decode0": back, "encode0": back / 2}}


def test_host_fault_figures_are_the_worst_round_against_the_targets():
    result = {"cut": [_round(0, 0.6, 2.0), _round(0, 0.9, 6.0)],
              "redis_restart": [{"requests": 5, "lost": 1, "away_s": 3.5, "not_ready_after_s": {"a": 2.1},
                                 "ready_again_after_s": {"a": 0.4}}],
              "partition": [{"lost": 0, "served_by_decode0": 3}]}
    shown = {f.name: f for f in multihost_faults.figures(result)}
    decode_seen = shown["decode host seen down after its link was cut"]
    assert decode_seen.value == pytest.approx(900) and decode_seen.passed is True
    assert shown["decode instance serving again after its link returned"].passed is False    # 6 s > 5 s
    assert shown["encode instance serving again after its link returned"].value == pytest.approx(3000)
    assert shown["requests lost, Redis restarted under load"].passed is False
    assert shown["requests lost, decode + encode links cut under load"].note == "20 requests"
    assert shown["decode streams resumed on the other decode instance"].value == 4


def test_redis_cluster_bandwidth_is_measured_on_both_backends():
    from tests.support.redis_cluster import RedisClusterNodes
    from tests.support.redis_server import RedisServer

    single, nodes = RedisServer().start(), RedisClusterNodes(3).start()
    try:
        rates = redis_cluster.bandwidth({"one Redis": single.url, "cluster": nodes.url}, mib=1, threads=2, entries=2,
                                        rounds=1)
    finally:
        single.cleanup()
        nodes.cleanup()
    assert set(rates) == {"one Redis", "cluster"} and all(r > 0 for r in rates.values())
