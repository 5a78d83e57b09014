"""Routing policies and the coordinator's EC handle cache."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from coordinator.cluster import HandleCache
from coordinator.routing.policies import HashAffinity, LeastLoaded, RoundRobin, create_policy


def _instances(*loads):
    return [SimpleNamespace(address=f"10.0.0.{i}:1", inflight=load) for i, load in enumerate(loads)]


def test_least_loaded_picks_the_idlest_and_shares_ties():
    policy = LeastLoaded()
    pool = _instances(3, 0, 5, 0)
    picks = Counter(policy.choose(pool, None).address for _ in range(10))
    assert set(picks) == {"10.0.0.1:1", "10.0.0.3:1"}
    assert picks["10.0.0.1:1"] == picks["10.0.0.3:1"] == 5


def test_round_robin_cycles():
    policy = RoundRobin()
    pool = _instances(0, 0, 0)
    assert [policy.choose(pool, None).address for _ in range(4)] == [
        "10.0.0.0:1", "10.0.0.1:1", "10.0.0.2:1", "10.0.0.0:1"]


def test_affinity_is_stable_and_spreads_keys():
    policy = HashAffinity()
    pool = _instances(0, 0, 0)
    assert len({policy.choose(pool, "hash-a").address for _ in range(5)}) == 1
    spread = Counter(policy.choose(pool, f"key{i}").address for i in range(300))
    assert len(spread) == 3 and min(spread.values()) > 50


def test_affinity_moves_only_keys_of_a_removed_instance():
    policy = HashAffinity()
    pool = _instances(0, 0, 0)
    before = {k: policy.choose(pool, k).address for k in (f"k{i}" for i in range(200))}
    survivors = [i for i in pool if i.address != "10.0.0.2:1"]
    after = {k: policy.choose(survivors, k).address for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert all(before[k] == "10.0.0.2:1" for k in moved)


def test_unknown_policy_lists_supported():
    with pytest.raises(ValueError, match="affinity, least_loaded, round_robin"):
        create_policy("random")


def test_handle_cache_is_a_bounded_lru():
    cache = HandleCache(max_entries=2)
    cache.put("a", b"1")
    cache.put("b", b"2")
    assert cache.get("a") == b"1"       # a is now most recent
    cache.put("c", b"3")               # evicts b
    assert cache.get("b") is None and cache.get("a") == b"1" and cache.get("c") == b"3"
    cache.pop("a")
    assert cache.get("a") is None and len(cache) == 1
