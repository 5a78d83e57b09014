"""Tenant-scoped encoder cache on a real cluster: a client uuid names an item only within (model, cache_salt).

Paired cases: the same uuid and salt hit the cache (no second encode); the
same uuid under another salt (another tenant) or no salt misses and is
answered from its own image; different images without uuids never share an
entry.  Answers are checked token for token against `generate` on each image.
Hits and misses are read from the coordinator's
epd_coordinator_mm_items_total{source} counter.
"""

from __future__ import annotations

import uuid as uuidlib

import pytest

from tests.support.cluster import metric_value
from tests.support.images import data_url, noise_image

TEXT = "Describe this image."
MAX_TOKENS = 6
SOURCES = ("known", "cache_hit", "encoded", "inline")


def _sources(cluster) -> dict[str, float]:
    with cluster.client() as client:
        text = client.get("/metrics").text
    return {s: metric_value(text, "epd_coordinator_mm_items_total", f'source="{s}"') for s in SOURCES}


def _ask(cluster, image, uuid: str | None = None, salt: str | None = None) -> tuple[list[int], dict[str, float]]:
    """Greedy token ids for one image, and how the coordinator found its embedding."""
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    if uuid is not None:
        part["uuid"] = uuid
    body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": TEXT}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    before = _sources(cluster)
    with cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    after = _sources(cluster)
    return reply.json()["choices"][0]["token_ids"], {s: after[s] - before[s] for s in SOURCES if after[s] != before[s]}


@pytest.fixture(scope="module")
def images(reference):
    x, y = noise_image(112, 112, seed=9101), noise_image(112, 112, seed=9102)
    expected = [reference.greedy(TEXT, [image], MAX_TOKENS) for image in (x, y)]
    assert expected[0] != expected[1]  # otherwise a wrong embedding could not be told from a right one
    return (x, expected[0]), (y, expected[1])


def test_a_uuid_is_shared_within_a_salt_and_never_across(shm_cluster, images):
    (x, want_x), (y, want_y) = images
    uuid = f"img-{uuidlib.uuid4().hex[:8]}"
    assert _ask(shm_cluster, x, uuid, "tenant-a") == (want_x, {"encoded": 1})
    assert _ask(shm_cluster, x, uuid, "tenant-a") == (want_x, {"known": 1})  # same uuid + salt: a hit
    # Tenant B reuses tenant A's uuid with another image: its own entry, its own answer.
    assert _ask(shm_cluster, y, uuid, "tenant-b") == (want_y, {"encoded": 1})
    assert _ask(shm_cluster, y, uuid, None) == (want_y, {"encoded": 1})  # no salt is another scope too
    assert _ask(shm_cluster, x, uuid, "tenant-a") == (want_x, {"known": 1})  # A's entry is untouched


def test_different_images_never_share_an_entry(shm_cluster, images):
    (x, want_x), (y, want_y) = images
    salt = f"tenant-{uuidlib.uuid4().hex[:8]}"
    assert _ask(shm_cluster, x, salt=salt) == (want_x, {"encoded": 1})
    assert _ask(shm_cluster, y, salt=salt) == (want_y, {"encoded": 1})
    assert _ask(shm_cluster, y, salt=salt) == (want_y, {"known": 1})


def test_content_parts_scope_a_uuid_by_the_requests_salt(shm_cluster, images):
    """POST /inference/v1/generate with content_parts: the same rules as chat (the salt reaches render)."""
    (x, want_x), (y, want_y) = images
    uuid = f"part-{uuidlib.uuid4().hex[:8]}"
    with shm_cluster.client() as client:
        rendered = client.post(shm_cluster.http_urls("render")[0] + "/v1/chat/completions/render",
                               json={"messages": [{"role": "user", "content": [
                                   {"type": "image_url", "image_url": {"url": data_url(x)}},
                                   {"type": "text", "text": TEXT}]}]}).json()

    def generate(image, salt):
        body = {"token_ids": rendered["token_ids"], "cache_salt": salt,
                "content_parts": [{"type": "image_url", "url": data_url(image), "uuid": uuid}],
                "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0}}
        before = _sources(shm_cluster)
        with shm_cluster.client() as client:
            reply = client.post("/inference/v1/generate", json=body)
        assert reply.status_code == 200, reply.text
        after = _sources(shm_cluster)
        return reply.json()["choices"][0]["token_ids"], {s: after[s] - before[s] for s in SOURCES
                                                         if after[s] != before[s]}

    assert generate(x, "tenant-a") == (want_x, {"encoded": 1})
    assert generate(x, "tenant-a") == (want_x, {"known": 1})
    assert generate(y, "tenant-b") == (want_y, {"encoded": 1})
