"""llm-d's default (use_openai_format) calls, with the bodies docs/llm-d.md shows, against a real cluster.

The templates are read from docs/llm-d.md (so the page cannot drift from what is tested) and filled the
way llm-d's coordinator fills them: render -> one encode per image -> prefill (chat capped to one token +
tokens + merged ec_transfer_params + kv_transfer_params) -> decode (chat, image parts tagged with their
mm_hash, kv_transfer_params).  The decode answer must equal epd's own coordinator's for the same chat.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.images import chat, noise_image
from tests.support.scale_out import Orchestrator, sse_events

DOC = Path(__file__).resolve().parents[2] / "docs" / "llm-d.md"
CHAT = "/v1/chat/completions"
OMIT = object()
MAX_TOKENS = 12
CASES = {
    "text": ("Tell me a story about a lighthouse.", [], False),
    "one_image": ("Describe this image.", [(64, 48, 1)], False),
    "two_images_streamed": ("Compare these two images.", [(56, 84, 2), (112, 56, 3)], True),
}


def templates() -> dict[str, Any]:
    found = re.findall(r"<!-- llm-d openai-format: (\w+) -->\n```json\n(.*?)```", DOC.read_text(), re.S)
    return {name: json.loads(body) for name, body in found}


def fill(template: Any, values: dict[str, Any]) -> Any:
    """A template with its "<...>" values (and "<...>" spread keys) replaced; OMIT drops a field."""
    if isinstance(template, str) and template.startswith("<") and template.endswith(">"):
        return OMIT if template == "<removed>" else values[template]
    if isinstance(template, list):
        return [v for v in (fill(t, values) for t in template) if v is not OMIT]
    if not isinstance(template, dict):
        return template
    out: dict[str, Any] = {}
    for key, value in template.items():
        if key.startswith("<"):
            out.update(copy.deepcopy(values[key]))
            continue
        filled = fill(value, values)
        if filled is OMIT:
            out.pop(key, None)
        else:
            out[key] = filled
    return out if out or not template else OMIT


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for m in messages if isinstance(m.get("content"), list) for p in m["content"]
            if p.get("type") == "image_url"]


class LlmD:
    """The calls llm-d's coordinator makes, in its order, with the templates of docs/llm-d.md."""

    def __init__(self, orch: Orchestrator, request_id: str) -> None:
        self.orch, self.headers, self.tpl = orch, {"X-Request-Id": request_id}, templates()
        self.trace: dict[str, Any] = {}

    def call(self, role: str, body: dict[str, Any], path: str = CHAT) -> Any:
        self.trace.setdefault("bodies", {})[role] = body
        return self.orch.ok(role, path, body, headers=self.headers)

    def prepare(self, client: dict[str, Any]) -> dict[str, Any]:
        """render, encode, prefill: the decode body."""
        rendered = self.call("render", client, CHAT + "/render")
        features = rendered["features"] or {}
        hashes = (features.get("mm_hashes") or {}).get("image", [])
        merged: dict[str, Any] = {}
        for part in image_parts(client["messages"]):
            answer = self.call("encode", fill(self.tpl["encode"], {
                "<client model>": client.get("model", OMIT), "<image part i, as the client sent it>": part}))
            self.trace.setdefault("encode", []).append(answer)
            merged.update(answer["ec_transfer_params"] or {})
        prefill = self.call("prefill", fill(self.tpl["prefill"], {
            "<client request>": client, "<render token_ids>": rendered["token_ids"],
            "<render mm_hashes>": hashes or OMIT,
            "<render mm_placeholders>": (features.get("mm_placeholders") or {}).get("image") or OMIT,
            "<merged encode ec_transfer_params>": merged or OMIT}))
        self.trace.update(rendered=rendered, hashes=hashes, merged=merged, prefill=prefill)
        tagged = copy.deepcopy(client["messages"])
        for part, mm_hash in zip(image_parts(tagged), hashes, strict=True):
            part["uuid"] = mm_hash
        return fill(self.tpl["decode"], {
            "<client request>": client, "<prefill kv_transfer_params>": prefill["kv_transfer_params"],
            "<client messages, each image_url part with \"uuid\": its mm_hash>": tagged})


@pytest.fixture(scope="module")
def orch(shm_cluster):
    orchestrator = Orchestrator(shm_cluster)
    yield orchestrator
    orchestrator.close()


@pytest.fixture(scope="module")
def model(orch):
    return orch.http.get(orch.cluster.url + "/v1/models").json()["data"][0]["id"]


def _client(model: str, text: str, spec: list[tuple[int, int, int]], **extra: Any) -> dict[str, Any]:
    return {"model": model, **chat(text, [noise_image(w, h, s) for w, h, s in spec], max_tokens=MAX_TOKENS,
                                   temperature=0, **extra)}


def test_the_doc_has_the_three_templates():
    assert sorted(templates()) == ["decode", "encode", "prefill"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_llmd_openai_format_calls_answer_as_the_coordinator(orch, model, case):
    text, spec, stream = CASES[case]
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    client = _client(model, text, spec, **extra)
    llmd = LlmD(orch, f"llmd-{case}")
    decode_body = llmd.prepare(client)
    trace = llmd.trace
    direct = orch.ok("coordinator", CHAT, {**client, "stream": False})
    # what llm-d reads back: encode's handles keyed by render's mm_hashes, prefill's KV parameters
    assert [list(e["ec_transfer_params"]) for e in trace.get("encode", [])] == [[h] for h in trace["hashes"]]
    assert all(e["object"] == "chat.completion" and e["usage"]["completion_tokens"] == 0
               and e["choices"][0]["message"] == {"role": "assistant", "content": None}
               for e in trace.get("encode", []))
    prefill = trace["prefill"]
    assert prefill["object"] == "chat.completion" and prefill["id"] == f"chatcmpl-llmd-{case}"
    assert prefill["choices"][0]["message"] == {"role": "assistant", "content": None}
    assert {"do_remote_prefill", "handle", "num_prompt_tokens", "rope_delta", "first_token_id"} <= \
        set(prefill["kv_transfer_params"])
    assert prefill["usage"] == {**direct["usage"], "completion_tokens": 1,
                                "total_tokens": direct["usage"]["prompt_tokens"] + 1}
    assert prefill["kv_transfer_params"]["num_prompt_tokens"] == len(trace["rendered"]["token_ids"])
    assert ("ec_transfer_params" in trace["bodies"]["prefill"]) == bool(spec)
    assert ("features" in trace["bodies"]["prefill"]["tokens"]) == bool(spec)
    assert "stream_options" not in trace["bodies"]["prefill"]
    if not stream:
        answer = llmd.call("decode", decode_body)
        assert answer["id"] == f"chatcmpl-llmd-{case}"
        assert answer["choices"] == direct["choices"]
        assert answer["usage"] == direct["usage"]
        return
    with orch.http.stream("POST", orch.urls["decode"] + CHAT, json=decode_body, headers=llmd.headers) as reply:
        assert reply.status_code == 200
        events = sse_events(reply)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text_out = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text_out == direct["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == \
        direct["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == direct["usage"]


def test_decode_refuses_the_kv_of_another_prompt_and_keeps_it(orch, model):
    llmd = LlmD(orch, "llmd-mismatch")
    decode_body = llmd.prepare(_client(model, "Name three colours.", []))
    other = {**decode_body, "messages": [{"role": "user", "content": "Name three animals, please."}]}
    reply = orch.post("decode", CHAT, other)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "kv_prompt_mismatch"
    assert orch.post("decode", CHAT, decode_body).status_code == 200  # the entry was not consumed
    missing = {k: v for k, v in decode_body.items() if k != "kv_transfer_params"}
    reply = orch.post("decode", CHAT, missing)
    assert reply.status_code == 400
    assert reply.json()["error"] == {"message": "decode needs kv_transfer_params (from a prefill answer)",
                                     "type": "invalid_request_error", "code": "missing_kv_transfer_params"}


def test_prefill_refuses_tokens_render_did_not_make(orch, model):
    client = _client(model, "Count to five.", [])
    ids = orch.ok("render", CHAT + "/render", client)["token_ids"]
    body = fill(templates()["prefill"], {
        "<client request>": client, "<render token_ids>": [*ids[:3], ids[3] + 1, *ids[4:]],
        "<render mm_hashes>": OMIT, "<render mm_placeholders>": OMIT, "<merged encode ec_transfer_params>": OMIT})
    reply = orch.post("prefill", CHAT, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "tokens_mismatch"
    assert error["message"].startswith(f"tokens.token_ids differ from this chat's rendering at position 3 "
                                       f"({len(ids)} ids given, {len(ids)} rendered)")


def test_role_passes_render_errors_on(orch, model):
    encode = templates()["encode"]
    text_only = fill(encode, {"<client model>": model,
                              "<image part i, as the client sent it>": {"type": "text", "text": "hi"}})
    reply = orch.post("encode", CHAT, text_only)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "no_multimodal_items"
    client = _client("no-such-model", "x", [(32, 32, 4)])
    unknown = fill(encode, {"<client model>": "no-such-model",
                            "<image part i, as the client sent it>": image_parts(client["messages"])[0]})
    reply = orch.post("encode", CHAT, unknown)
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"
    assert reply.json()["error"]["message"].startswith("The model `no-such-model` does not exist")
