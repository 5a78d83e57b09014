"""Logprobs through the cluster: the sampled ids' and the top n's logprobs equal log_softmax of HF's logits.

The first token's come from prefill (through kv_transfer_params), the rest from decode's sampler;
/v1/chat/completions and /v1/completions answer OpenAI's shapes, /inference/v1/generate vLLM's
GenerateLogProbs (integer ids).  Bad values are a 400 naming the field.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.images import chat, noise_image

MAX_TOKENS = 6
TEXT = "Describe this image."
TOL = 1e-4


@pytest.fixture(scope="module")
def expected(reference):
    ids, logits = reference.greedy_with_logits(TEXT, [noise_image(64, 48, 7)], MAX_TOKENS)
    return ids, [torch.log_softmax(step, dim=-1) for step in logits]


def _post(cluster, path, body):
    with cluster.client() as client:
        return client.post(path, json=body)


def _chat(top: int, **extra) -> dict:
    return chat(TEXT, [noise_image(64, 48, 7)], max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                top_logprobs=top, return_token_ids=True, **extra)


def _check_top(entry_top: list, reference_row: torch.Tensor, n: int) -> None:
    values, _ = reference_row.topk(n)
    got = [t["logprob"] for t in entry_top]
    assert len(got) == n and got == sorted(got, reverse=True)
    assert got == pytest.approx(values.tolist(), abs=TOL)


def test_chat_logprobs_equal_hf_log_softmax(shm_cluster, expected, reference):
    ids, rows = expected
    reply = _post(shm_cluster, "/v1/chat/completions", _chat(5))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["token_ids"] == ids
    content = choice["logprobs"]["content"]
    assert len(content) == len(ids)
    for entry, token, row in zip(content, ids, rows, strict=True):
        text = reference.tokenizer.decode([token])
        assert entry["token"] == text and entry["bytes"] == list(text.encode())
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=TOL)
        _check_top(entry["top_logprobs"], row, 5)
        assert entry["top_logprobs"][0]["token"] == text  # greedy: the sampled token is the most likely


def test_streamed_chat_logprobs_equal_the_whole_answer(shm_cluster, expected):
    whole = _post(shm_cluster, "/v1/chat/completions", _chat(2)).json()["choices"][0]["logprobs"]["content"]
    reply = _post(shm_cluster, "/v1/chat/completions", _chat(2, stream=True))
    events = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [e for ev in events for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == whole and len(whole) == len(expected[0])


def test_completion_logprobs(shm_cluster, reference):
    body = {"prompt": "The lighthouse keeper", "max_tokens": 4, "temperature": 0, "logprobs": 3}
    reply = _post(shm_cluster, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(4)]
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                 strict=True):
        assert top[token] == value and 3 <= len(top) <= 4  # the sampled token and the 3 most likely


def test_generate_answers_vllms_generate_logprobs(shm_cluster):
    """Same prompt, same greedy tokens and logprobs as the chat answer, in vLLM's id-only shape."""
    asked = chat("Tell me a story.", max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                 return_token_ids=True)
    answer = _post(shm_cluster, "/v1/chat/completions", asked).json()
    openai = answer["choices"][0]["logprobs"]["content"]
    body = {"token_ids": answer["prompt_token_ids"],
            "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 2}}
    reply = _post(shm_cluster, "/inference/v1/generate", body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["token_ids"] == answer["choices"][0]["token_ids"]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    for entry, theirs in zip(content, openai, strict=True):
        assert set(entry) == {"token_id", "logprob", "rank", "top_logprobs"} and entry["rank"] == 1
        assert entry["logprob"] == pytest.approx(theirs["logprob"], abs=TOL)
        top = entry["top_logprobs"]  # vLLM's order: the sampled token first (greedy: rank 1), then rank 2
        assert [t["rank"] for t in top] == [1, 2] and top[0]["token_id"] == entry["token_id"]
        assert [t["logprob"] for t in top] == pytest.approx([t["logprob"] for t in theirs["top_logprobs"]],
                                                             abs=TOL)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/inference/v1/generate", {"sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
    ("/inference/v1/generate", {"sampling_params": {"logprobs": 30}}, "sampling_params.logprobs"),
])
def test_bad_logprobs_values_are_a_400_naming_the_field(shm_cluster, path, body, field):
    base = {"/v1/chat/completions": chat("Hi", max_tokens=2), "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
            "/inference/v1/generate": {"token_ids": [9707, 11]}}[path]
    reply = _post(shm_cluster, path, {**base, **body})
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert field in message, message
