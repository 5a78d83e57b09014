"""Request ids are labels on a real cluster: echoed and logged, never a key two requests can collide on.

Two concurrent requests with the same X-Request-Id both run and get their own
answers; aborts by id reach only the requests made with the aborting API key
(the admin token reaches all).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx

from tests.e2e.conftest import ADMIN_TOKEN, PUBLIC_KEYS
from tests.support.cluster import metric_value

PROMPTS = ("Tell me about lighthouses.", "Name three rivers.")


def _headers(key: str, label: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"X-Request-Id": label} if label else {})}


def _chat(cluster, text: str, key: str, label: str | None = None, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=_headers(key, label), timeout=120)


def _concurrently(*calls):
    results: list = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i, c=c: results.__setitem__(i, c())) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return results


def test_two_requests_with_one_id_both_get_their_own_answer(secure_cluster):
    key = PUBLIC_KEYS[0]
    alone = [_chat(secure_cluster, text, key).json()["choices"][0]["token_ids"] for text in PROMPTS]
    assert alone[0] != alone[1]
    label = f"dup-{uuid.uuid4().hex[:8]}"
    replies = _concurrently(*(lambda t=t: _chat(secure_cluster, t, key, label) for t in PROMPTS))
    for reply, want in zip(replies, alone, strict=True):
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-request-id"] == label
        assert reply.json()["id"] == f"chatcmpl-{label}"
        assert reply.json()["choices"][0]["token_ids"] == want
    streamed = _concurrently(*(lambda t=t: _chat(secure_cluster, t, key, label, stream=True) for t in PROMPTS))
    for reply in streamed:
        assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n"), reply.text[-300:]
        assert '"error"' not in reply.text and f'"id": "chatcmpl-{label}"' in reply.text.replace('":"', '": "')


def test_the_label_is_logged_with_a_unique_suffix(secure_cluster):
    label = f"logged-{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        assert _chat(secure_cluster, "hi", PUBLIC_KEYS[0], label, max_tokens=2).status_code == 200
    time.sleep(0.5)
    ids = set()
    for line in secure_cluster.output:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if str(entry.get("request_id", "")).startswith(label + "-"):
            ids.add((entry["role"], entry["request_id"]))
    internal = {rid for _, rid in ids}
    assert len(internal) == 2, ids  # one internal id per request, the label first
    assert {"coordinator", "render", "prefill", "decode"} <= {role for role, _ in ids}


def test_generate_echoes_its_request_id(secure_cluster):
    label = f"gen-{uuid.uuid4().hex[:8]}"
    body = {"token_ids": [1, 2, 3], "request_id": label, "sampling_params": {"max_tokens": 2}}
    replies = _concurrently(*(lambda: httpx.post(secure_cluster.url + "/inference/v1/generate", json=body,
                                                 headers=_headers(PUBLIC_KEYS[1]), timeout=120),) * 2)
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["request_id"] == f"generate-tokens-{label}" and reply.headers["x-request-id"] == label


def _slots(cluster) -> float:
    return metric_value(httpx.get(cluster.http_urls("decode")[0] + "/metrics", timeout=10).text,
                        "epd_decode_slots_used")


def _abort(cluster, label: str, credential: str) -> dict:
    reply = httpx.post(cluster.admin_url + "/abort_requests", json={"request_ids": [f"chatcmpl-{label}"]},
                       headers={"Authorization": f"Bearer {credential}"}, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_an_abort_reaches_only_the_requests_of_its_api_key(secure_cluster):
    label = f"shared-{uuid.uuid4().hex[:8]}"
    a, b = PUBLIC_KEYS
    results: dict[str, httpx.Response] = {}

    def run(name: str, key: str) -> None:
        results[name] = _chat(secure_cluster, "Tell a long story.", key, label, max_tokens=600, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(name, key)) for name, key in (("a", a), ("b", b))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while _slots(secure_cluster) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort(secure_cluster, label, b) == {"aborted": 1}       # tenant B's own request only
    assert _abort(secure_cluster, "no-such-request", ADMIN_TOKEN) == {"aborted": 0}
    for thread in threads:
        thread.join(180)
    assert results["b"].status_code == 499 and results["b"].json()["error"]["code"] == "aborted"
    assert results["a"].status_code == 200, results["a"].text
    assert results["a"].json()["usage"]["completion_tokens"] == 600
