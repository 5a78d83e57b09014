"""Redis restarts under load: the requests it hits wait it out (and encode or prefill again), full recovery without
restarting anything.

While Redis is down the roles that use it (all four: render writes processed images to the mm store, encode
reads them) are not ready (GET /ready 503 naming Redis, gRPC health
NOT_SERVING), so the coordinator stops sending them work and is itself not ready.

The cluster keeps EC and KV entries in its own Redis; the test kills that
Redis mid-run and starts it again on the same port (empty: no persistence).
Entries stored before are gone, so remembered embeddings are re-encoded.
After the cluster stops, no key of epd's is left in Redis.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from tests.support.cluster import metric_value, start_cluster
from tests.support.faults import LoadRun, coordinator_metrics, role_pid
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


def test_a_redis_restart_mid_load_fails_no_request_then_full_recovery(redis_faults):
    server, cluster = redis_faults
    pids = {role: role_pid(cluster, role, index) for role, index in ROLES}
    # Ten images, reused: after the restart the coordinator still remembers handles whose entries are gone.
    bodies = [chat(f"Picture {i}?", [noise_image(56, 56, seed=600 + i % 10)], max_tokens=3) for i in range(150)]
    run = LoadRun(cluster.url, bodies, concurrency=4, pace_s=0.05, hooks={40: _restart(server, 0.7)})
    results = asyncio.run(run.run())
    statuses = [r.status for r in results]
    assert statuses == [200] * len(results), [(r.status, r.body) for r in results if r.status != 200][:3]
    waited = sum(metric_value(coordinator_metrics(cluster), "epd_coordinator_retries_total", f'reason="{code}"')
                 for code in ("ec_store_unavailable", "kv_store_unavailable", "mm_store_unavailable"))
    assert waited >= 1, "the outage met no request"                 # the ones it met waited it out
    assert max(r.seconds for r in results) < 15.0                   # nothing hangs
    with cluster.client() as client:
        for seed in range(600, 610):                                  # remembered images: re-encoded
            reply = client.post("/v1/chat/completions", json=chat("Again?", [noise_image(56, 56, seed)],
                                                                  max_tokens=2))
            assert reply.status_code == 200, reply.text
    assert {role: role_pid(cluster, role, index) for role, index in ROLES} == pids   # no process restarted


def _wait_status(url: str, status: int, deadline_s: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + deadline_s
    while True:
        reply = httpx.get(url, timeout=5)
        if reply.status_code == status or time.monotonic() > deadline:
            return reply
        time.sleep(0.1)


def test_readiness_follows_redis_while_liveness_stays(redis_faults):
    server, cluster = redis_faults
    roles = {role: cluster.http_urls(role)[0] for role in ("render", "encode", "prefill", "decode")}
    for url in roles.values():
        assert httpx.get(url + "/ready", timeout=5).json()["status"] == "ready"
    server.stop()
    try:
        where = f"127.0.0.1:{server.port}/0"
        for role, url in roles.items():
            reply = _wait_status(url + "/ready", 503)
            assert reply.status_code == 503, (role, reply.text)
            body = reply.json()
            assert body["status"] == "not_ready" and body["role"] == role
            purposes = {"render": ["mm"], "encode": ["ec", "mm"], "prefill": ["ec", "kv", "mm"],
                        "decode": ["kv"]}[role]
            assert [p.split(":")[0] for p in body["problems"]] == [f"{p} store (redis)" for p in purposes]
            assert all(f"Redis at {where} is not reachable (" in p for p in body["problems"]), body
            live = httpx.get(url + "/health", timeout=5)
            assert live.status_code == 200 and live.json()["ready"] is False     # alive, only not ready
        coordinator = _wait_status(cluster.url + "/ready", 503)                  # no ready instance of a role
        assert coordinator.status_code == 503, coordinator.text
        assert coordinator.json()["problems"] == [
            f"no ready {role} instance (1 known; GET /ready on each says why)"
            for role in ("render", "encode", "prefill", "decode")]
        assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200  # alive all the same
    finally:
        server.start()
    for url in [*roles.values(), cluster.url]:
        assert _wait_status(url + "/ready", 200).status_code == 200
    # the coordinator's 200 names it (`epd serve` trusts no other server's answer on its port)
    assert httpx.get(cluster.url + "/ready", timeout=5).json()["instance_id"].endswith("_coordinator")
    with cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=chat("Back?", [noise_image(56, 56, 990)], max_tokens=2))
        assert reply.status_code == 200, reply.text


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
