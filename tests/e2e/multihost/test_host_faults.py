"""Host faults across real hosts (network namespaces), under streaming load, with the figures' targets (issue 38):

- a decode host's and an encode host's links cut at once: no request lost (the decode streams are resumed on the
  other decode, the encodes fail over), each seen down within 1 s; links back: each instance announces itself
  again and serves within 5 s, nothing restarted;
- Redis killed and started again, empty, 3.5 s later: no request lost (those in flight wait it out and encode or
  prefill again), the roles and the coordinator not ready while it is away, ready again once it is back;
- prefill and a decode host partitioned from each other: no request lost, that decode still serves (KV goes
  through Redis).

benchmarks/multihost_faults.py runs the same scenarios (tests/support/host_faults.py) and writes the figures to
docs/faults.md.
"""

from __future__ import annotations

import asyncio

from tests.support import host_faults


def test_cut_decode_and_encode_hosts_lose_nothing_and_come_back(multihost):
    pids = {h: p.pid for h, p in multihost.processes.items()}
    result = asyncio.run(host_faults.cut_and_restore(multihost))
    assert result["requests"] >= 20 and result["lost"] == 0, result
    assert max(result["seen_down_s"].values()) < 1.0, result
    assert max(result["serving_again_s"].values()) < 5.0, result
    assert {h: p.pid for h, p in multihost.processes.items()} == pids
    assert all(p.poll() is None for p in multihost.processes.values())


def test_a_redis_restart_loses_nothing_and_readiness_follows_it(multihost):
    result = asyncio.run(host_faults.redis_restart(multihost))
    assert result["requests"] >= 10 and result["lost"] == 0, result
    assert max(result["not_ready_after_s"].values()) < result["away_s"], result
    assert max(result["ready_again_after_s"].values()) < 5.0, result


def test_prefill_partitioned_from_a_decode_host_still_reaches_it_through_redis(multihost):
    result = asyncio.run(host_faults.partition(multihost))
    assert result["lost"] == 0 and result["served_by_decode0"] >= 1, result
