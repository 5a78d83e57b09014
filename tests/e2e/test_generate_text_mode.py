"""/inference/v1/generate with output_mode "text" (vLLM's GenerateText* shapes) on the coordinator and decode.

The oracle is the coordinator's own chat completion of the same prompt ids with the same greedy
params: its text (stop strings applied), its token ids, its logprobs (greedy: the sampled token is the
most likely, so generate's engine order and chat's sorted order coincide).  Tokens mode stays as it was.
"""

from __future__ import annotations

import pytest

from tests.support.scale_out import Orchestrator, sse_events

GENERATE = "/inference/v1/generate"
MAX_TOKENS = 12
PROMPT = "Tell me a short story about a cat."


@pytest.fixture(scope="module")
def orch(shm_cluster):
    orchestrator = Orchestrator(shm_cluster)
    yield orchestrator
    orchestrator.close()


def _chat(orch, **sampling) -> dict:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **sampling}
    return orch.ok("coordinator", "/v1/chat/completions", body)


@pytest.fixture(scope="module")
def plain(orch) -> dict:
    return _chat(orch)


def _generate(orch, prompt_ids, mode="text", role="coordinator", **sampling) -> dict:
    body = {"token_ids": prompt_ids, "output_mode": mode,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, **sampling}}
    return orch.ok(role, GENERATE, body)


def _stop_string(text: str) -> tuple[str, int]:
    """Three characters from the middle of `text` and where they first occur."""
    k = next(i for i in range(len(text) // 3, len(text) - 3) if not text[i].isspace())
    stop = text[k:k + 3]
    return stop, text.index(stop)


def test_text_mode_equals_the_chat_answer_and_tokens_mode(orch, plain):
    prompt = plain["prompt_token_ids"]
    chat_choice = plain["choices"][0]
    text = _generate(orch, prompt)
    tokens = _generate(orch, prompt, mode="tokens")
    assert text["output_mode"] == "text" and tokens["output_mode"] == "tokens"
    [choice] = text["choices"]
    assert choice["text"] == chat_choice["message"]["content"] and len(choice["text"]) > 6
    assert choice["token_ids"] == chat_choice["token_ids"] == tokens["choices"][0]["token_ids"]
    assert choice["finish_reason"] == tokens["choices"][0]["finish_reason"] == chat_choice["finish_reason"]
    assert "text" not in tokens["choices"][0] and text["usage"] == tokens["usage"]
    assert text["request_id"].startswith("generate-tokens-")


def test_a_stop_string_is_excluded_unless_asked_for(orch, plain):
    whole = plain["choices"][0]["message"]["content"]
    stop, at = _stop_string(whole)
    prompt = plain["prompt_token_ids"]
    excluded = _generate(orch, prompt, stop=[stop])["choices"][0]
    included = _generate(orch, prompt, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    tokens = _generate(orch, prompt, mode="tokens", stop=[stop])["choices"][0]
    assert excluded["text"] == whole[:at] == _chat(orch, stop=[stop])["choices"][0]["message"]["content"]
    assert included["text"] == whole[:at + len(stop)]
    assert excluded["finish_reason"] == included["finish_reason"] == "stop"
    assert excluded["stop_reason"] == included["stop_reason"] == stop
    # token_ids keep every generated token, the one that completed the stop string included
    assert excluded["token_ids"] == included["token_ids"] == tokens["token_ids"]
    assert len(tokens["token_ids"]) < len(plain["choices"][0]["token_ids"])


def _stream(orch, role, body) -> list:
    base = orch.cluster.url if role == "coordinator" else orch.urls[role]
    with orch.http.stream("POST", base + GENERATE, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        return sse_events(reply)


def test_streamed_text_deltas_concatenate_to_the_whole_text(orch, plain):
    whole = plain["choices"][0]["message"]["content"]
    stop, at = _stop_string(whole)
    body = {"token_ids": plain["prompt_token_ids"], "output_mode": "text", "stream": True,
            "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop]}}
    events = _stream(orch, "coordinator", body)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert {e["output_mode"] for e in events[:-1]} == {"text"}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(
        len(c["choices"][0]["token_ids"]) for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole[:at]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == _generate(orch, plain["prompt_token_ids"], mode="tokens", stop=[stop])["choices"][0]["token_ids"]


def test_text_mode_logprobs_are_the_chat_logprobs(orch, plain):
    chat = _chat(orch, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    text = _generate(orch, plain["prompt_token_ids"], logprobs=2)["choices"][0]["logprobs"]["content"]
    assert len(text) == len(chat) == len(plain["choices"][0]["token_ids"])
    assert [e["token"] for e in text] == [e["token"] for e in chat]
    assert all(e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2 for e in text)
    for ours, theirs in zip(text, chat, strict=True):
        assert ours["logprob"] == pytest.approx(theirs["logprob"], abs=1e-5)
        assert [t["token"] for t in ours["top_logprobs"]] == [t["token"] for t in theirs["top_logprobs"]]
        assert ours["top_logprobs"][0]["token"] == ours["token"]  # greedy: sampled = most likely


def test_decode_answers_text_mode_as_the_coordinator(orch, plain):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0}
    generate = orch.render(body)
    assert generate["token_ids"] == plain["prompt_token_ids"]
    prefill = orch.ok("prefill", GENERATE, orch.prefill_body(generate, None))
    decoded = orch.ok("decode", GENERATE, orch.decode_body(generate, prefill["kv_transfer_params"],
                                                           output_mode="text"))
    assert decoded["output_mode"] == "text"
    assert decoded["choices"][0]["text"] == plain["choices"][0]["message"]["content"]
    assert decoded["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    prefill = orch.ok("prefill", GENERATE, orch.prefill_body(generate, None))
    events = _stream(orch, "decode", orch.decode_body(generate, prefill["kv_transfer_params"], output_mode="text",
                                                      stream=True))
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == decoded["choices"][0]["text"]


def test_text_mode_refusals(orch, plain):
    body = {"token_ids": plain["prompt_token_ids"], "output_mode": "text", "sampling_params": {"detokenize": False}}
    reply = orch.post("coordinator", GENERATE, body)
    assert reply.status_code == 400
    assert "output_mode='text' requires sampling_params.detokenize to be true" in reply.json()["error"]["message"]
    generate = orch.render({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2})
    reply = orch.post("prefill", GENERATE, {**orch.prefill_body(generate, None), "output_mode": "text"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "unsupported_output_mode"
    assert reply.json()["error"]["message"] == ("prefill answers output_mode 'tokens' only; output_mode 'text' is "
                                                "served by decode and the coordinator")
