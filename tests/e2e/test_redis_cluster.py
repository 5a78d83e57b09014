"""`epd serve` on a real 3-node Redis Cluster (redis+cluster://): greedy answers equal `generate`, embeddings, KV
and processed images spread over the nodes, and one node killed under load fails no request (its entries become
misses: encoded or prefilled again, puts go to the live nodes)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.cluster import metric_value, start_cluster
from tests.support.faults import LoadRun, coordinator_metrics
from tests.support.images import chat, noise_image
from tests.support.redis_cluster import RedisClusterNodes

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def on_redis_cluster(demo_model_path):
    nodes = RedisClusterNodes(3).start()
    try:
        cluster = start_cluster("--ec-connector", "redis", "--kv-connector", "redis", "--redis-url", nodes.url,
                                "--ec-capacity-mb", "32", "--kv-capacity-mb", "32", "--max-model-len", "1024")
    except BaseException:
        nodes.cleanup()
        raise
    yield nodes, cluster
    cluster.stop()
    nodes.cleanup()


def test_greedy_answers_equal_generate_with_entries_over_every_node(on_redis_cluster, reference):
    nodes, cluster = on_redis_cluster
    images = [noise_image(56 + 8 * i, 56, 1300 + i) for i in range(6)]
    with cluster.client() as client:
        for image in images:
            body = chat("What is in it?", [image], max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == reference.greedy("What is in it?", [image], MAX_TOKENS)
    per_node = nodes.keys_per_node("epd:ec:*")
    assert sum(per_node.values()) == len(images) and len([n for n in per_node.values() if n]) >= 2, per_node


def test_a_node_killed_under_load_fails_no_request(on_redis_cluster):
    nodes, cluster = on_redis_cluster
    # 12 images asked over and over: after the kill the coordinator remembers handles on the lost node.
    bodies = [chat(f"Picture {i}?", [noise_image(48, 48, seed=1400 + i % 12)], max_tokens=3) for i in range(96)]

    async def kill_one() -> None:
        await asyncio.to_thread(nodes.kill, nodes.ports[0])

    results = asyncio.run(LoadRun(cluster.url, bodies, concurrency=4, hooks={30: kill_one}).run())
    assert [r.status for r in results] == [200] * len(results), \
        [(r.status, r.body) for r in results if r.status != 200][:3]
    text = coordinator_metrics(cluster)
    again = metric_value(text, "epd_coordinator_retries_total", 'reason="ec_entry_missing"') + \
        metric_value(text, "epd_coordinator_retries_total", 'reason="kv_entry_missing"')
    assert again >= 1, "no request met an entry on the lost node"   # misses, encoded or prefilled again
    for role in ("encode", "prefill", "decode"):                      # a cluster with a live node is ready
        assert httpx.get(cluster.http_urls(role)[0] + "/ready", timeout=10).status_code == 200
