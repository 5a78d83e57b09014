"""vLLM's own pydantic models judge epd's JSON, and both sides' validators judge the same edge cases.

Runs vLLM's classes in the vLLM venv (tests/interop/vllm_check.py) on bodies epd produced in-process:
a render answer (text and images), generate answers, derender answers.  The edge cases are the
issue's table plus cache_salt's rules: each either gets the same accept/reject from both, or is listed
in docs/protocol.md's edge-case table with the reason (checked here, so the page cannot drift).  The
compatibility table's rows must name every field vLLM's models have.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.peers.vllm_env import ensure_venv
from services.protocol.answers import GenerateAnswer, OpenAIAnswer, OutputDelta
from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateRequest, GenerateResponse
from services.protocol.logprobs import TokenLogprob, chat_logprobs, completion_logprobs, generate_logprobs
from services.protocol.openai import ChatCompletionRequest
from services.protocol.parsing import parse_model
from services.render.serving import RenderService
from tests.support.images import data_url, noise_image

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "protocol.md").read_text()
GRID = ("ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAABAAAAAAAAAAEAAAAAAAAAKVmaWVs"
        "ZJKnYmF0Y2hlZIGra2VlcF9vbl9jcHXD")


def vllm_judge(jobs: list[tuple[str, object]]) -> dict:
    python = ensure_venv() / "bin" / "python"
    out = subprocess.run([str(python), str(ROOT / "tests" / "interop" / "vllm_check.py")],
                         input=json.dumps({"validate": jobs}), capture_output=True, text=True, timeout=600,
                         env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def rendered(demo_model_path) -> dict:
    service = RenderService(demo_model_path, "epd-demo-qwen2-vl")
    try:
        chat = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(noise_image(300, 200, 1))}},
            {"type": "text", "text": "What?"}]}], "max_tokens": 4}
        prompt = asyncio.run(service.render_chat(ChatCompletionRequest.model_validate(chat), "chatcmpl-x"))
        return {"generate": prompt.to_generate_request().model_dump(mode="json"), "chat": chat}
    finally:
        service.close()


def _mm(token_ids=None, **features) -> dict:
    base = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
            "kwargs_data": None, "mm_metadata": None}
    return {"token_ids": token_ids or [1, 2, 3, 4], "features": {**base, **features},
            "sampling_params": {"max_tokens": 2}}


EDGE_CASES = {
    "kwargs_data_null_entry": _mm(kwargs_data={"image": [None]}),
    "unsorted_placeholders": _mm([1, 5, 5, 2, 5, 5], mm_hashes={"image": ["a", "b"]},
                                 mm_placeholders={"image": [{"offset": 4, "length": 2}, {"offset": 1, "length": 2}]}),
    "n_2": {"token_ids": [1, 2], "sampling_params": {"n": 2}},
    "no_sampling_params": {"token_ids": [1, 2]},
    "token_id_beyond_vocabulary": {"token_ids": [1, 2**31 - 1], "sampling_params": {}},
    "negative_token_id": {"token_ids": [1, -1], "sampling_params": {}},
    "metadata_only_without_ec": _mm(mm_metadata={"image": [GRID]}),
    "placeholder_past_prompt": _mm([1, 2]),
    "empty_cache_salt": {"token_ids": [1], "sampling_params": {}, "cache_salt": ""},
    "cache_salt_129_chars": {"token_ids": [1], "sampling_params": {}, "cache_salt": "s" * 129},
    "cache_salt_with_slash": {"token_ids": [1], "sampling_params": {}, "cache_salt": "a/b"},
    "content_parts_and_features": {**_mm(), "content_parts": [{"type": "image_url", "url": "http://x/a.png"}]},
    "output_mode_text": {"token_ids": [1], "sampling_params": {}, "output_mode": "text"},
    "output_mode_text_without_detokenize": {"token_ids": [1], "sampling_params": {"detokenize": False},
                                            "output_mode": "text"},
    "logprobs_minus_one": {"token_ids": [1], "sampling_params": {"logprobs": -1}},
    "logprobs_20": {"token_ids": [1], "sampling_params": {"logprobs": 20}},
}


def _epd_accepts(body: dict) -> bool:
    try:
        parse_model(GenerateRequest, body)
        return True
    except InvalidRequest:
        return False


def _documented_differences() -> dict[str, str]:
    """Rows of docs/protocol.md's edge-case table: | `name` | vLLM | epd | why |."""
    section = DOC.split("### Edge cases: epd's validators against vLLM's", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (accepts|rejects) \| (accepts|rejects) \|", section, re.M)
    return {name: (vllm, epd) for name, vllm, epd in rows}


def test_edge_cases_agree_or_are_documented():
    verdicts = vllm_judge([("GenerateRequest", body) for body in EDGE_CASES.values()])["results"]
    documented = _documented_differences()
    for (name, body), vllm in zip(EDGE_CASES.items(), verdicts, strict=True):
        theirs = "accepts" if vllm["ok"] else "rejects"
        ours = "accepts" if _epd_accepts(body) else "rejects"
        if theirs == ours:
            assert name not in documented or documented[name] == (theirs, ours), name
        else:
            assert documented.get(name) == (theirs, ours), f"{name}: vLLM {theirs}, epd {ours}: not in docs"


def test_vllms_models_validate_epds_json(rendered):
    generate = rendered["generate"]
    answer = GenerateResponse(request_id="generate-tokens-chatcmpl-x", model="m",
                              choices=[{"index": 0, "token_ids": [9707, 11], "finish_reason": "length"}],
                              usage={"prompt_tokens": len(generate["token_ids"]), "completion_tokens": 2})
    answer_json = answer.model_dump(mode="json")
    chunk = {**answer_json, "choices": [{"index": 0, "token_ids": [9707]}]}
    jobs = [("GenerateRequest", generate), ("MultiModalFeatures", generate["features"]),
            ("GenerateTokensResponse", answer_json), ("GenerateTokensStreamResponse", chunk),
            ("DerenderChatRequest", {"generate_response": answer_json, "prompt_tokens": 5,
                                     "chat_request": rendered["chat"]}),
            ("DerenderChatStreamRequest", {"stream": True, "generate_chunk": chunk, "prompt_tokens": 5})]
    results = vllm_judge(jobs)["results"]
    assert [r["error"] for r in results] == [""] * len(jobs)


# A sampled token at rank 3 with its top 3 (the sampled one among them), and a greedy one; texts as decode adds.
LOGPROBS = [TokenLogprob(9707, -2.5, 3, (11, 13, 9707), (-0.5, -1.0, -2.5), "Hello", (",", ".", "Hello")),
            TokenLogprob(11, -0.25, 1, (11, 13, 0), (-0.25, -2.0, -3.0), ",", (",", ".", "!"))]


def test_vllms_models_validate_epds_logprobs():
    """The three shapes epd answers logprobs in, judged by vLLM's own response models."""
    choice = {"index": 0, "token_ids": [9707, 11], "finish_reason": "length", "logprobs": generate_logprobs(LOGPROBS)}
    generate = GenerateResponse(request_id="generate-tokens-x", model="m", choices=[choice],
                                usage={"prompt_tokens": 3, "completion_tokens": 2}).model_dump(mode="json")
    chunk = {**generate, "choices": [{**choice, "token_ids": [9707], "logprobs": generate_logprobs(LOGPROBS[:1])}]}
    chat = OpenAIAnswer("chat", "chatcmpl-x", "m", prompt_tokens=3)
    chat_body = chat.response([chat.choice("Hello,", "length", logprobs=chat_logprobs(LOGPROBS))],
                              {"prompt_tokens": 3, "completion_tokens": 2}).model_dump(mode="json")
    done = OpenAIAnswer("completion", "cmpl-x", "m", prompt_tokens=3)
    done_body = done.response([done.choice("Hello,", "length", logprobs=completion_logprobs(LOGPROBS))],
                              {"prompt_tokens": 3, "completion_tokens": 2}).model_dump(mode="json")
    jobs = [("GenerateTokensResponse", generate), ("GenerateTokensStreamResponse", chunk),
            ("ChatCompletionResponse", chat_body), ("CompletionResponse", done_body)]
    results = vllm_judge(jobs)["results"]
    assert [r["error"] for r in results] == [""] * len(jobs)
    top = generate["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["token_id"] for t in top] == [9707, 11, 13]  # vLLM's engine order: sampled first, then by rank


def test_vllms_models_validate_epds_text_mode_answers():
    """output_mode "text", whole and streamed, with logprobs, as GenerateAnswer builds it: vLLM's GenerateText*."""
    deltas = [OutputDelta([9707], "Hello", logprobs=LOGPROBS[:1]),
              OutputDelta([11], "", "stop", ",", logprobs=LOGPROBS[1:])]

    async def source():
        for delta in deltas:
            yield delta

    async def build():
        whole = await GenerateAnswer("generate-tokens-x", "m", 3, output_mode="text").collect(source())
        events = [e async for e in GenerateAnswer("generate-tokens-x", "m", 3, output_mode="text").sse(source())]
        return whole.model_dump(mode="json"), [json.loads(e[len(b"data: "):]) for e in events[:-1]]

    whole, chunks = asyncio.run(build())
    assert whole["choices"][0]["text"] == "Hello" and [c["choices"][0]["text"] for c in chunks] == ["Hello", ""]
    jobs = [("GenerateTextResponse", whole), *(("GenerateTextStreamResponse", c) for c in chunks)]
    results = vllm_judge(jobs)["results"]
    assert [r["error"] for r in results] == [""] * len(jobs)


def test_the_compatibility_table_names_every_vllm_field():
    fields = vllm_judge([])["fields"]
    table = DOC.split("### Field by field", 1)[1].split("\n### ", 1)[0]
    named = set(re.findall(r"^\| `([A-Za-z]+)\.([a-z_]+)` \|", table, re.M))
    for model in ("GenerateRequest", "MultiModalFeatures", "GenerateTokensResponse", "DerenderChatRequest",
                  "DerenderChatStreamRequest", "DerenderChatStreamResponse"):
        missing = [f for f in fields[model] if (model, f) not in named]
        assert not missing, f"docs/protocol.md's field table lacks {model}: {missing}"
