"""SSE exactly as PROTOCOL.md on decode and the coordinator; streaming derender; abort; max_tokens default."""

from __future__ import annotations

import pytest

from tests.support.images import chat, noise_image
from tests.support.scale_out import Orchestrator, sse_events

GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def orch(shm_cluster):
    orchestrator = Orchestrator(shm_cluster)
    yield orchestrator
    orchestrator.close()


def _prefilled(orch, body):
    """A render answer and a fresh prefill of it (each decode consumes its KV entry)."""
    generate = orch.render(body)
    ec = orch.encode(generate)["ec_transfer_params"] if generate.get("features") else None
    prefill = orch.ok("prefill", GENERATE, orch.prefill_body(generate, ec))
    return generate, prefill["kv_transfer_params"]


def _stream(orch, role, body, **kwargs):
    with orch.http.stream("POST", (orch.cluster.url if role == "coordinator" else orch.urls[role]) + GENERATE,
                          json=body, **kwargs) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        return sse_events(reply)


def _check_stream(events, whole):
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + \
        [whole["choices"][0]["finish_reason"]]
    [request_id] = {c["request_id"] for c in events[:-1]}
    assert request_id.startswith("generate-tokens-")
    assert all("kv_transfer_params" not in c for c in chunks)
    return chunks


def test_decode_streams_token_deltas_usage_and_done(orch):
    body = chat("Stream this.", [noise_image(56, 56, 60)], max_tokens=10, temperature=0)
    generate, kv = _prefilled(orch, body)
    whole = orch.ok("decode", GENERATE, orch.decode_body(generate, kv))
    generate, kv = _prefilled(orch, body)
    streamed = orch.decode_body(generate, kv, stream=True, stream_options={"include_usage": True})
    chunks = _check_stream(_stream(orch, "decode", streamed), whole)
    # streaming derender with a carried stream_state gives the non-streamed text
    text, finish, state, out = "", None, None, []
    for event in [*chunks, {"request_id": whole["request_id"], "choices": [], "usage": whole["usage"]}]:
        answer = orch.ok("render", "/v1/chat/completions/derender", {
            "generate_response": event, "chat_request": body, "stream": True, "stream_state": state,
            "prompt_tokens": generate["token_ids"]})
        state = answer["stream_state"]
        out.extend(answer["chunks"])
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for chunk in out[1:-1]:
        text += chunk["choices"][0]["delta"].get("content", "")
        finish = chunk["choices"][0]["finish_reason"] or finish
    assert out[-1]["choices"] == [] and out[-1]["usage"] == whole["usage"]
    assert len({c["id"] for c in out}) == 1
    plain = orch.ok("render", "/v1/chat/completions/derender", {
        "generate_response": whole, "chat_request": body, "prompt_tokens": generate["token_ids"]})
    assert text == plain["choices"][0]["message"]["content"]
    assert finish == plain["choices"][0]["finish_reason"]


def test_continuous_usage_stats(orch):
    generate, kv = _prefilled(orch, chat("Count.", max_tokens=5, temperature=0))
    body = orch.decode_body(generate, kv, stream=True,
                            stream_options={"include_usage": False, "continuous_usage_stats": True})
    events = _stream(orch, "decode", body)
    assert events[-1] == "[DONE]"
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == list(range(1, 6)) and all(e["choices"] for e in events[:-1])


def test_coordinator_streams_like_decode(orch):
    rendered = orch.render(chat("Both ways.", [noise_image(84, 56, 61)], max_tokens=8, temperature=0))
    whole = orch.ok("coordinator", GENERATE, rendered)
    events = _stream(orch, "coordinator", {**rendered, "stream": True, "stream_options": {"include_usage": True}})
    _check_stream(events, whole)
    assert events[0]["request_id"] == whole["request_id"] == "generate-tokens-" + rendered["request_id"]


def test_abort_requests_ends_a_running_decode(orch):
    generate, kv = _prefilled(orch, chat("Go on forever.", temperature=0))
    body = orch.decode_body(generate, kv, stream=True)
    body["sampling_params"] = {**body["sampling_params"], "max_tokens": 4000, "ignore_eos": True}
    url = orch.urls["decode"] + GENERATE
    with orch.http.stream("POST", url, json=body, headers={"X-Request-Id": "abort-me"}) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        aborted = orch.ok("decode", "/abort_requests", {"request_ids": ["generate-tokens-abort-me"]})
        rest = [line for line in lines if line.startswith("data: ")]
    assert aborted == {"aborted": 1}
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"abort"' in rest[-2]
    assert orch.ok("decode", "/abort_requests", {"request_ids": ["abort-me"]}) == {"aborted": 0}
    for role in ("encode", "prefill"):
        assert orch.ok(role, "/abort_requests", {"request_ids": ["abort-me"]}) == {"aborted": 0}


def test_max_tokens_absent_means_the_rest_of_the_context(orch):
    """Not 16: a stop token id first seen after position 16 still ends the output, by "stop"."""
    rendered = orch.render(chat("Say many things.", temperature=0))
    probe = orch.ok("coordinator", GENERATE, {**rendered, "sampling_params": {"temperature": 0, "max_tokens": 40}})
    tokens = probe["choices"][0]["token_ids"]
    late = [(i, t) for i, t in enumerate(tokens) if i >= 16 and t not in tokens[:i]]
    # The demo model is seeded: its answer here always has one (a changed model must pick another prompt).
    assert late, f"no token first seen after position 16 in {tokens}: choose a prompt that has one"
    index, stop_id = late[0]
    sampling = {"temperature": 0, "stop_token_ids": [stop_id]}
    # render writes the rest of the context explicitly, as vLLM's does; generate without it does the same
    assert rendered["sampling_params"]["max_tokens"] == 8192 - len(rendered["token_ids"])
    via_coordinator = orch.ok("coordinator", GENERATE, {**rendered, "sampling_params": sampling})
    generate, kv = _prefilled(orch, chat("Say many things.", temperature=0))
    via_decode = orch.ok("decode", GENERATE, {**orch.decode_body(generate, kv), "sampling_params": sampling})
    for answer in (via_coordinator, via_decode):
        choice = answer["choices"][0]
        assert choice["token_ids"] == tokens[:index + 1]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
