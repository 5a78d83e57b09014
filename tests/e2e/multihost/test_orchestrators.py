"""The reference orchestrators in front of epd's roles on separate hosts.

vLLM's E/P/D proxy (tests/support/vllm_proxy.py: its calls, order and bodies) sends prefill no ec_transfer_params:
prefill finds each embedding by its mm_hash in the EC store, where encode put it, and encodes nothing itself; the
client's answer equals epd's coordinator's for text, one image, several images and a repeated image, streamed and
not.  llm-d's generate path (pixels straight to prefill, no encode call: prefill encodes them itself, once) and
completions path work; there llm-d's prefill bodies carry none of the client's sampling parameters, so the first
token is prefill's own draw and the rest must be the greedy continuation after it (docs/llm-d.md).
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from tests.support.cluster import metric_value
from tests.support.images import chat, noise_image
from tests.support.vllm_proxy import PREFILL_KV, VllmEpdProxy

MODEL = "epd-demo-qwen2-vl"
MAX_TOKENS = 10
CASES = {
    "text": ("Tell me about harbours.", []),
    "one_image": ("Describe this image.", [(64, 48, 11)]),
    "two_images": ("Compare these two images.", [(56, 84, 12), (112, 56, 13)]),
    "repeated_image": ("Are these the same?", [(64, 64, 14), (64, 64, 14)]),
}


def client_body(case: str, stream: bool) -> dict:
    text, spec = CASES[case]
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    return chat(text, [noise_image(w, h, s) for w, h, s in spec], model=MODEL, max_tokens=MAX_TOKENS,
                temperature=0, stream=stream, **extra)


def sse(text: str) -> dict:
    """An SSE answer as what a client reads from it: text, finish reason, usage, the end marker."""
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    events = [json.loads(e) for e in lines if e != "[DONE]"]
    return {"text": "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"]),
            "finish": [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")],
            "usage": [e["usage"] for e in events if e.get("usage")], "done": lines[-1:] == ["[DONE]"],
            "errors": [e for e in events if "error" in e]}


def essentials(answer: dict) -> dict:
    choice = answer["choices"][0]
    return {"text": choice["message"]["content"], "finish": choice["finish_reason"], "usage": answer["usage"]}


def prefill_counters(cluster) -> tuple[float, float]:
    text = httpx.get(cluster.http_url("prefill") + "/metrics", timeout=10).text
    return (metric_value(text, "epd_prefill_ec_lookups_total", 'result="found"'),
            metric_value(text, "epd_prefill_inline_encoded_items_total"))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_epd_proxy_in_front_of_the_roles_answers_as_the_coordinator(multihost, case, stream):
    proxy = VllmEpdProxy([multihost.http_url("encode0"), multihost.http_url("encode1")],
                         multihost.http_url("prefill"), multihost.http_url("decode1"))
    found, inline = prefill_counters(multihost)
    status, answer = asyncio.run(proxy.chat(client_body(case, stream), request_id=f"vllm-{case}-{stream}"))
    assert status == 200, answer
    ours = httpx.post(multihost.url + "/v1/chat/completions", json=client_body(case, stream), timeout=120)
    assert ours.status_code == 200, ours.text
    if stream:
        theirs, mine = sse(answer), sse(ours.text)
        assert theirs == mine and theirs["done"] and not theirs["errors"] and len(theirs["text"]) > 0
    else:
        assert essentials(answer) == essentials(ours.json())
    images = len(CASES[case][1])
    roles = [(role, rid) for role, _, rid, _ in proxy.calls]
    rid = f"vllm-{case}-{stream}"
    assert [r for r, _ in roles] == ["encode"] * images + ["prefill", "decode"]
    assert all(i.startswith(f"{rid}:") for _, i in roles[:images]) and [i for _, i in roles[images:]] == [rid] * 2
    prefill_body = proxy.calls[images][3]
    assert "ec_transfer_params" not in prefill_body and prefill_body["kv_transfer_params"] == PREFILL_KV
    assert prefill_counters(multihost) == (found + images, inline)   # found by mm_hash, none encoded in prefill


def llmd_prefill_kv(kv: dict) -> dict:
    """llm-d's decode kv_transfer_params: everything prefill answered, marked as a remote prefill's."""
    return {**kv, "do_remote_decode": False, "do_remote_prefill": True}


def test_llmd_generate_path_sends_pixels_to_prefill_which_encodes_them_once(multihost):
    """The render answer (kwargs_data included) as the client's GenerateRequest; prefill gets it capped to one
    token with the transfer parameters in extra_args, decode the client's body with prefill's KV."""
    rid = "llmd-gen-" + uuid.uuid4().hex[:6]
    with httpx.Client(timeout=120, headers={"X-Request-Id": rid}) as http:
        image = noise_image(72, 56, 21)
        client = http.post(multihost.http_url("render") + "/v1/chat/completions/render",
                           json=chat("What is this?", [image], model=MODEL, max_tokens=MAX_TOKENS,
                                     temperature=0)).json()
        found, inline = prefill_counters(multihost)
        prefill = http.post(multihost.http_url("prefill") + "/inference/v1/generate", json={
            "request_id": rid, "token_ids": client["token_ids"], "model": MODEL,
            "sampling_params": {"max_tokens": 1, "extra_args": {"kv_transfer_params": PREFILL_KV}},
            "features": {k: client["features"][k] for k in ("mm_hashes", "mm_placeholders", "kwargs_data")}})
        assert prefill.status_code == 200, prefill.text
        assert prefill_counters(multihost) == (found, inline + 1)   # stored nowhere: encoded by prefill, once
        kv = prefill.json()["kv_transfer_params"]
        decode = http.post(multihost.http_url("decode1") + "/inference/v1/generate",
                           json={**client, "kv_transfer_params": llmd_prefill_kv(kv)})
        assert decode.status_code == 200, decode.text
        tokens = decode.json()["choices"][0]["token_ids"]
        # the greedy continuation after prefill's own first token, as epd's coordinator answers it
        rest = http.post(multihost.url + "/inference/v1/generate", json={
            **client, "request_id": rid + "-ref", "token_ids": [*client["token_ids"], kv["first_token_id"]],
            "sampling_params": {**client["sampling_params"], "max_tokens": MAX_TOKENS - 1}})
        assert rest.status_code == 200, rest.text
    assert tokens == [kv["first_token_id"], *rest.json()["choices"][0]["token_ids"]]


def test_llmd_completions_path(multihost):
    """render /v1/completions/render; prefill /v1/completions {model, prompt: ids, capped, request_id, kv params};
    decode /v1/completions: the client's body, prompt = the ids, prefill's KV."""
    rid = "llmd-cmpl-" + uuid.uuid4().hex[:6]
    client = {"model": MODEL, "prompt": "The lighthouse keeper said", "max_tokens": MAX_TOKENS, "temperature": 0,
              "return_token_ids": True}
    with httpx.Client(timeout=120, headers={"X-Request-Id": rid}) as http:
        [rendered] = http.post(multihost.http_url("render") + "/v1/completions/render", json=client).json()
        ids = rendered["token_ids"]
        prefill = http.post(multihost.http_url("prefill") + "/v1/completions", json={
            "model": MODEL, "prompt": ids, "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
            "request_id": rid, "kv_transfer_params": PREFILL_KV})
        assert prefill.status_code == 200, prefill.text
        answer = prefill.json()
        assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 1
        kv = answer["kv_transfer_params"]
        decode = http.post(multihost.http_url("decode0") + "/v1/completions",
                           json={**client, "prompt": ids, "kv_transfer_params": llmd_prefill_kv(kv)})
        assert decode.status_code == 200, decode.text
        theirs = decode.json()
        rest = http.post(multihost.url + "/v1/completions", json={**client, "prompt": [*ids, kv["first_token_id"]],
                                                                   "max_tokens": MAX_TOKENS - 1}).json()
    assert theirs["object"] == "text_completion" and theirs["usage"]["prompt_tokens"] == len(ids)
    assert theirs["choices"][0]["token_ids"] == [kv["first_token_id"], *rest["choices"][0]["token_ids"]]
    assert theirs["choices"][0]["text"].endswith(rest["choices"][0]["text"])
