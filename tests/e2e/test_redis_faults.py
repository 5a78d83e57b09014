"""Redis restarts under load: clear 503s for the requests it hits, full recovery without restarting anything.

The cluster keeps EC and KV entries in its own Redis; the test kills that
Redis mid-run and starts it again on the same port (empty: no persistence).
Entries stored before are gone, so remembered embeddings are re-encoded.
After the cluster stops, no key of epd's is left in Redis.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from tests.support.cluster import start_cluster
from tests.support.faults import LoadRun, role_pid
from tests.support.images import chat, noise_image
from tests.support.redis_server import RedisServer

ROLES = (("render", 0), ("encode", 0), ("prefill", 0), ("decode", 0))


@pytest.fixture(scope="module")
def redis_faults(demo_model_path):
    server = RedisServer().start()
    cluster = start_cluster("--ec-connector", "redis", "--kv-connector", "redis", "--redis-url", server.url,
                            "--ec-capacity-mb", "16", "--kv-capacity-mb", "16", "--max-model-len", "1024")
    yield server, cluster
    if cluster.process.poll() is None:
        cluster.stop()
    server.cleanup()


def _restart(server: RedisServer, down_s: float):
    async def hook():
        server.stop()
        stopped = time.monotonic()
        await asyncio.sleep(down_s)
        await asyncio.to_thread(server.start)
        return stopped, time.monotonic()
    return hook


def test_a_redis_restart_mid_load_gives_503s_then_full_recovery(redis_faults):
    server, cluster = redis_faults
    pids = {role: role_pid(cluster, role, index) for role, index in ROLES}
    # Ten images, reused: after the restart the coordinator still remembers handles whose entries are gone.
    bodies = [chat(f"Picture {i}?", [noise_image(56, 56, seed=600 + i % 10)], max_tokens=3) for i in range(150)]
    run = LoadRun(cluster.url, bodies, concurrency=4, pace_s=0.05, hooks={40: _restart(server, 0.7)})
    results = asyncio.run(run.run())
    statuses = [r.status for r in results]
    assert set(statuses) <= {200, 503}, [(r.status, r.body) for r in results if r.status not in (200, 503)][:3]
    failed = [r for r in results if r.status == 503]
    assert failed, "the outage hit no request"
    for r in failed:
        error = r.body["error"]
        assert error["code"] in ("ec_store_unavailable", "kv_store_unavailable"), error
        assert "redis" in error["message"], error
    assert max(r.seconds for r in results) < 15.0                   # failing is fast, nothing hangs
    assert statuses[-40:] == [200] * 40, statuses[-40:]              # recovered, under the same load
    with cluster.client() as client:
        for seed in range(600, 610):                                  # remembered images: re-encoded
            reply = client.post("/v1/chat/completions", json=chat("Again?", [noise_image(56, 56, seed)],
                                                                  max_tokens=2))
            assert reply.status_code == 200, reply.text
    assert {role: role_pid(cluster, role, index) for role, index in ROLES} == pids   # no process restarted


def test_no_epd_key_is_left_in_redis_after_shutdown(redis_faults):
    server, cluster = redis_faults
    with cluster.client() as client:
        for seed in range(700, 705):
            reply = client.post("/v1/chat/completions", json=chat("x", [noise_image(56, 56, seed)], max_tokens=2))
            assert reply.status_code == 200
    client = redis.Redis.from_url(server.url)
    assert client.keys("epd:ec:*"), "the encoders should hold embeddings while serving"
    assert cluster.stop() == 0
    assert client.keys("epd:*") == []
