"""Instances die under load (kill -9): requests not yet at decode still succeed, survivors carry the load.

These tests kill instances of the shared pool cluster; they run after the
admission tests (file order) and mark the cluster damaged, so a later user
gets a fresh one.  The last test stops it and checks that nothing is left in
/dev/shm.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.support.cluster import metric_value
from tests.support.faults import (
    LoadRun,
    StreamLog,
    calls,
    coordinator_metrics,
    grpc_address,
    kill9,
    stream_chat,
    wait_marked_down,
)
from tests.support.images import chat, noise_image


@pytest.fixture(scope="module")
def pool(pool_clusters):
    return pool_clusters.intact()


def _killer(cluster, holder, role: str, index: int):
    """A hook for LoadRun: kill the instance, time how long until the coordinator routes around it."""
    address = grpc_address(cluster, role, index)

    async def hook():
        holder.damaged = True
        kill9(cluster, role, index)
        down_after = await wait_marked_down(cluster.url, address)
        await asyncio.sleep(1.0)
        text = await asyncio.to_thread(coordinator_metrics, cluster)
        return down_after, calls(text, address, "ok") + calls(text, address, "failed")

    return hook


def test_killing_an_encode_then_a_prefill_instance_under_load_loses_no_request(pool, pool_clusters):
    bodies = [chat(f"Image {i}?", [noise_image(56, 56, seed=20_000 + i)], max_tokens=4) for i in range(120)]
    before = coordinator_metrics(pool)
    survivors = {role: grpc_address(pool, role, 1) for role in ("encode", "prefill")}
    run = LoadRun(pool.url, bodies, concurrency=6,
                  hooks={30: _killer(pool, pool_clusters, "encode", 0), 70: _killer(pool, pool_clusters, "prefill", 0)})
    results = asyncio.run(run.run())
    failed = [(r.index, r.status, r.error, r.body) for r in results if r.status != 200]
    assert not failed, failed[:3]
    after = coordinator_metrics(pool)
    for done, role in ((30, "encode"), (70, "prefill")):
        down_after, calls_then = run.hook_results[done]
        dead = grpc_address(pool, role, 0)
        assert down_after < 1.0, (role, down_after)                       # out of rotation within a second
        assert calls(after, dead, "ok") + calls(after, dead, "failed") == calls_then, role  # no work since
        gained = calls(after, survivors[role], "ok") - calls(before, survivors[role], "ok")
        assert gained > 0, role                                            # the survivor carries the load
    assert metric_value(after, "epd_coordinator_instance_healthy", f'instance="{survivors["encode"]}"') == 1


async def _streams_with_a_decode_killed(pool, holder, count: int) -> tuple[list[StreamLog], float]:
    logs = [StreamLog() for _ in range(count)]
    body = chat("Tell a long story.", max_tokens=300, ignore_eos=True, stream_options={"include_usage": True})
    tasks = [asyncio.create_task(stream_chat(pool.url, body, log, timeout_s=170.0)) for log in logs]
    deadline = time.monotonic() + 60
    while any(log.tokens() < 3 for log in logs) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    holder.damaged = True
    killed_at = kill9(pool, "decode", 0)
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    return logs, killed_at


def test_a_decode_killed_mid_stream_loses_no_stream_and_its_usage_counts_every_token(pool, pool_clusters):
    """The killed instance's streams go on on the other one (resumed: coordinator/pipeline.py): no error event,
    each ends at its 300 tokens with usage counting all of them once."""
    logs, killed_at = asyncio.run(_streams_with_a_decode_killed(pool, pool_clusters, 4))
    assert [log.error_event() for log in logs] == [None] * 4
    for log in logs:
        assert log.finish_reason() == "length" and log.events[-1][1] == "[DONE]"
        assert log.events[-2][1]["usage"]["completion_tokens"] == 300
    assert metric_value(coordinator_metrics(pool), "epd_coordinator_resumed_streams_total") >= 1
    with pool.client() as client:  # a request arriving now goes to the survivor
        reply = client.post("/v1/chat/completions", json=chat("Still there?", max_tokens=3))
    assert reply.status_code == 200, reply.text


def test_with_every_encoder_dead_prefill_encodes_inline_and_output_is_unchanged(pool, pool_clusters, reference):
    image = noise_image(112, 112, seed=31337)
    pool_clusters.damaged = True
    for index in range(2):
        try:
            kill9(pool, "encode", index)
        except (LookupError, ProcessLookupError):
            pass  # killed by an earlier test
    time.sleep(1.0)
    with pool.client() as client:
        reply = client.post("/v1/chat/completions",
                            json=chat("Describe this image.", [image], max_tokens=8, temperature=0,
                                      return_token_ids=True))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == reference.greedy("Describe this image.", [image], 8)
    assert metric_value(coordinator_metrics(pool), "epd_coordinator_mm_items_total", 'source="inline"') >= 1


def test_shutdown_after_the_faults_leaves_no_shared_memory(pool, pool_clusters):
    instance_id = pool_clusters.instance_id
    pool_clusters.stop()
    assert [name for name in os.listdir("/dev/shm") if instance_id in name] == []
