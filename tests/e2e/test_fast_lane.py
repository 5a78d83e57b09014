"""On one host the coordinator reaches each role over its fast lane (services/rpc/fastlane.py); with TLS, over gRPC.

Read from each role's own counter of calls it served over the fast lane (`epd_fast_lane_calls_total`), around one
image request through the real cluster: render, encode, prefill and decode each served their call there.  The
exactness and error suites run through the same clusters, so every answer and error code they check came over
the fast lane too.
"""

from __future__ import annotations

import httpx

from tests.e2e.conftest import PUBLIC_KEYS
from tests.support.cluster import metric_value
from tests.support.images import chat, noise_image
from tests.support.scale_out import sse_events

METHODS = {"render": "RenderChat", "encode": "Encode", "prefill": "Prefill", "decode": "Decode"}


def _served(cluster) -> dict[str, float]:
    return {role: metric_value(cluster.metrics(role), "epd_fast_lane_calls_total", f'method="{method}"')
            for role, method in METHODS.items()}


def test_each_role_serves_the_coordinator_over_its_fast_lane(shm_cluster):
    before = _served(shm_cluster)
    body = chat("Describe it.", [noise_image(224, 224, seed=4401)], max_tokens=3, temperature=0)
    reply = httpx.post(shm_cluster.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    after = _served(shm_cluster)
    assert {role: after[role] - before[role] for role in METHODS} == {role: 1.0 for role in METHODS}


def test_with_tls_every_hop_stays_on_grpc(secure_cluster):
    body = chat("Describe it.", [noise_image(224, 224, seed=4402)], max_tokens=2, temperature=0)
    reply = httpx.post(secure_cluster.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {PUBLIC_KEYS[0]}"})
    assert reply.status_code == 200, reply.text
    assert _served(secure_cluster) == {role: 0.0 for role in METHODS}


def _ahead(cluster) -> dict[tuple[str, str], float]:
    """epd_coordinator_ahead_calls_total by (role, outcome)."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(cluster.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("epd_coordinator_ahead_calls_total{"):
            head, _, value = line.rpartition(" ")
            labels = dict(part.split("=") for part in head[head.index("{") + 1:-1].split(","))
            out[(labels["role"].strip('"'), labels["outcome"].strip('"'))] = float(value)
    return out


def _delta(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}


def test_prefill_and_decode_are_called_ahead_of_their_inputs_and_each_answer_goes_on(shm_cluster):
    """A new image: while render computes, encode is called ahead, and while encode computes, prefill and decode
    are; each answer goes on to the next call straight from the role that answered (forwarded; render's, when
    render read the FORWARD after it answered, by the coordinator as it reads it: relayed).  The same request
    again (the handle known here) takes the same path, with two timings left open: encode gets render's whole
    answer and looks the image up, answering at once, so its step may be over before prefill's call could be
    opened (prefill then gets a whole call), and prefill may be computing when decode's FORWARD comes (relayed).
    Both answers are the same tokens."""
    warm = chat("Warm up.", [noise_image(224, 224, seed=4407)], max_tokens=1)   # every fast-lane connection open
    assert httpx.post(shm_cluster.url + "/v1/chat/completions", json=warm, timeout=120).status_code == 200
    body = chat("Describe it.", [noise_image(224, 224, seed=4403)], max_tokens=4, temperature=0)
    answers, deltas = [], []
    for _ in range(2):
        before = _ahead(shm_cluster)
        reply = httpx.post(shm_cluster.url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answers.append(reply.json()["choices"][0]["message"]["content"])
        deltas.append(_delta(before, _ahead(shm_cluster)))
    assert deltas[0] == {("encode", "opened"): 1.0, ("encode", "forwarded"): 1.0, ("prefill", "opened"): 1.0,
                         ("prefill", "forwarded"): 1.0, ("decode", "opened"): 1.0, ("decode", "forwarded"): 1.0}
    went_on = {role: (role, "forwarded") if (role, "forwarded") in deltas[1] else (role, "relayed")
               for role in ("encode", "prefill", "decode")}
    prefill_ahead = {("prefill", "opened"): 1.0, went_on["prefill"]: 1.0} if ("prefill", "opened") in deltas[1] else {}
    assert deltas[1] == {("encode", "opened"): 1.0, went_on["encode"]: 1.0, **prefill_ahead,
                         ("decode", "opened"): 1.0, went_on["decode"]: 1.0}
    assert answers[0] == answers[1] and answers[0]
    assert metric_value(shm_cluster.metrics("decode"), "epd_decode_kv_blocks_reserved") == 0.0


def test_with_tls_no_call_is_opened_ahead(secure_cluster):
    body = chat("Describe it.", [noise_image(224, 224, seed=4404)], max_tokens=2, temperature=0)
    reply = httpx.post(secure_cluster.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {PUBLIC_KEYS[0]}"})
    assert reply.status_code == 200, reply.text
    assert _ahead(secure_cluster) == {}


def test_encode_called_ahead_encodes_only_the_images_it_does_not_hold(shm_cluster):
    """Render's answer goes on to encode as it is: a prompt with one known and one new image makes encode encode
    the new one and look the known one up; the coordinator counts each image once, by where its embedding came
    from (the known one: known; the new one: encoded)."""
    known, new = noise_image(224, 224, seed=4405), noise_image(224, 224, seed=4406)
    first = httpx.post(shm_cluster.url + "/v1/chat/completions", json=chat("A.", [known], max_tokens=2), timeout=120)
    assert first.status_code == 200, first.text

    def items() -> dict[str, float]:
        text, coordinator = shm_cluster.metrics("encode"), httpx.get(shm_cluster.url + "/metrics", timeout=10).text
        return {**{result: metric_value(text, "epd_encode_items_total", f'result="{result}"')
                   for result in ("encoded", "cache_hit")},
                **{source: metric_value(coordinator, "epd_coordinator_mm_items_total", f'source="{source}"')
                   for source in ("known", "encoded")}}

    before, ahead_before = items(), _ahead(shm_cluster)
    reply = httpx.post(shm_cluster.url + "/v1/chat/completions", json=chat("B.", [known, new], max_tokens=2),
                       timeout=120)
    assert reply.status_code == 200, reply.text
    after = items()
    assert {k: after[k] - before[k] for k in after} == {"encoded": 1.0, "cache_hit": 1.0, "known": 1.0}
    went = _delta(ahead_before, _ahead(shm_cluster))
    assert went.get(("encode", "forwarded"), 0.0) + went.get(("encode", "relayed"), 0.0) == 1.0


def _first_chunks(cluster) -> dict[str, float]:
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    return {outcome: metric_value(text, "epd_coordinator_first_chunks_total", f'outcome="{outcome}"')
            for outcome in ("same", "different", "missing")}


def test_the_first_token_goes_out_with_prefill_answer_and_decode_says_the_same(shm_cluster):
    """Decode's call opened ahead says when its blocks are reserved; prefill answers the first token as decode's
    first chunk (services/decode/judge.py), so the coordinator streams it before decode read the KV, then checks
    decode's own first chunk against it.  The stream is the same answer as a whole one; a first token that ends
    the answer (max_tokens=1) is the whole answer, usage included; with logprobs decode sends the first token."""
    image = noise_image(224, 224, seed=4411)
    cases = [({"max_tokens": 5, "temperature": 0}, 1.0), ({"max_tokens": 1, "temperature": 0}, 1.0),
             ({"max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1}, 0.0)]
    for extra, early in cases:
        body = chat("Describe it.", [image], **extra)
        whole = httpx.post(shm_cluster.url + "/v1/chat/completions", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        before = _first_chunks(shm_cluster)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", shm_cluster.url + "/v1/chat/completions", json=stream, timeout=120) as reply:
            assert reply.status_code == 200
            events = sse_events(reply)
        after = _first_chunks(shm_cluster)
        assert {k: after[k] - before[k] for k in after} == {"same": early, "different": 0.0, "missing": 0.0}, extra
        assert events[-1] == "[DONE]"
        choices = [c for e in events[:-1] for c in e["choices"]]
        text = "".join(c["delta"].get("content") or "" for c in choices)
        finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
        assert (text, finish) == (whole.json()["choices"][0]["message"]["content"],
                                  [whole.json()["choices"][0]["finish_reason"]]), extra
        assert events[-2]["usage"] == whole.json()["usage"], extra
    assert metric_value(shm_cluster.metrics("decode"), "epd_decode_kv_blocks_reserved") == 0.0
