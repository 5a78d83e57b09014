"""Hostile input against the coordinator and every role's HTTP API: a 4xx JSON error, never a 5xx or a crash.

The corpus (tests/support/hostile.py) covers malformed and deeply nested
JSON, wrong types, huge and negative numbers, enormous strings, invalid
base64, corrupt, truncated and decompression-bomb images, 1x1 and
20000x20000 px images, wrong serializations, pickles inside msgpack, SSRF
URLs (IPv6 and numeric forms, metadata address, redirect targets, other
schemes), wrong placeholders, unknown mm_hashes and bogus transfer params.
Role processes are checked for survival afterwards by serving a request.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.hostile import Case, chat_with, coordinator_cases, image_part, role_cases
from tests.support.images import data_url, noise_image


def _base_url(cluster, target: str) -> str:
    if target in ("coordinator", "admin"):
        return cluster.url if target == "coordinator" else cluster.admin_url
    return cluster.http_urls(target)[0]


def _send(cluster, case: Case) -> httpx.Response:
    url = _base_url(cluster, case.target) + case.path
    headers = [("Content-Type", b"application/json"), *case.headers]
    with httpx.Client(timeout=60) as client:
        if isinstance(case.body, bytes):
            return client.post(url, content=case.body, headers=headers)
        return client.post(url, json=case.body, headers=headers)


@pytest.fixture(scope="module")
def rendered(shm_cluster):
    body = chat_with(image_part(data_url(noise_image(56, 56, seed=5150))))
    reply = httpx.post(shm_cluster.http_urls("render")[0] + "/v1/chat/completions/render", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _cases() -> list[Case]:
    return coordinator_cases() + role_cases(_placeholder_rendered())


def _placeholder_rendered() -> dict:
    """Parametrize ids need the names before a cluster exists; bodies are rebuilt from the real answer."""
    return {"token_ids": [1], "features": {"mm_hashes": {"image": ["h"]},
                                           "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
                                           "kwargs_data": {"image": ["AA=="]}, "mm_metadata": {"image": ["AA=="]}}}


CASE_NAMES = [case.name for case in _cases()]


def test_the_corpus_is_large_and_covers_every_http_api():
    cases = _cases()
    assert len(cases) >= 50
    assert {case.target for case in cases} == {"coordinator", "admin", "render", "encode", "prefill", "decode"}


@pytest.fixture(scope="module")
def corpus(rendered) -> dict[str, Case]:
    return {case.name: case for case in coordinator_cases() + role_cases(rendered)}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_hostile_input_gets_a_4xx_json_error(shm_cluster, corpus, name):
    case = corpus[name]
    reply = _send(shm_cluster, case)
    if case.may_succeed and reply.status_code == 200:
        return
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text[:500])
    error = reply.json()["error"]
    assert {"message", "type", "code"} <= set(error)


def test_every_process_still_serves_after_the_corpus(shm_cluster):
    with shm_cluster.client() as client:
        reply = client.post("/v1/chat/completions",
                            json=chat_with(image_part(data_url(noise_image(56, 56, seed=5151))), max_tokens=3))
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert client.get("/health").status_code == 200
    for role in ("render", "encode", "prefill", "decode"):
        assert httpx.get(shm_cluster.http_urls(role)[0] + "/health", timeout=10).status_code == 200
