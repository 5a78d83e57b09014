"""Render's HTTP routes over the real RenderService (starlette TestClient, no network).

Also the interop claims of docs/protocol.md: a render answer for the demo model is what the Hugging Face
Qwen2-VL processor (which vLLM's render runs) produces — token ids of the chat template, placeholder
counts per image size, kwargs tensor shapes — and mm_metadata for a 4x4 grid is the golden vector.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from starlette.applications import Starlette
from starlette.testclient import TestClient

from services.models.input_norm import NormParams, normalize_pixels
from services.models.processing import load_processor
from services.protocol.generate import GenerateRequest
from services.protocol.serialization import item_from_b64
from services.render.api_router import routes
from services.render.serving import RenderService
from tests.support.images import data_url, noise_image

MODEL = "epd-demo"
GOLDEN = ("ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAABAAAAAAAAAAEAAAAAAAAAKVmaWVsZJKnYmF0Y2hl"
          "ZIGra2VlcF9vbl9jcHXD")
HELLO_IDS = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 9707, 151645,
             198, 151644, 77091, 198]


@pytest.fixture(scope="module")
def service(demo_model_path):
    svc = RenderService(demo_model_path, MODEL)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(Starlette(routes=routes(service))) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def hf(demo_model_path):
    return load_processor(demo_model_path)


def _chat(text, images=(), **extra):
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], **extra}


def smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 16384):
    """Qwen2-VL's resize rule (HF Qwen2VLImageProcessor and vLLM share it), for the demo's settings."""
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def no_limit_expected(client, num_prompt_tokens):
    """max_tokens absent: vLLM's render writes the rest of the context explicitly."""
    return client.get("/v1/models").json()["data"][0]["max_model_len"] - num_prompt_tokens


def test_text_chat_render_posts_unchanged(client):
    reply = client.post("/v1/chat/completions/render", json=_chat("Hello", max_tokens=5, cache_salt="s"),
                        headers={"X-Request-Id": "r-1"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["token_ids"] == HELLO_IDS and body["features"] is None
    assert body["request_id"] == "chatcmpl-r-1" and body["cache_salt"] == "s" and body["model"] == MODEL
    assert body["sampling_params"]["max_tokens"] == 5
    # vLLM's render bookkeeping, and the newer top-level fields
    sampling = body["sampling_params"]
    assert (sampling["output_kind"], sampling["skip_clone"], sampling["bad_words"],
            sampling["skip_reading_prefix_cache"]) == (2, True, [], False)
    assert body["output_mode"] == "tokens" and body["return_token_ids"] is None
    no_limit = client.post("/v1/chat/completions/render", json=_chat("Hello")).json()
    assert no_limit["sampling_params"]["max_tokens"] == no_limit_expected(client, len(HELLO_IDS))
    assert no_limit["request_id"].startswith("chatcmpl-")
    assert GenerateRequest.model_validate(body).token_ids == body["token_ids"]


@pytest.mark.parametrize("sizes", [[(56, 56)], [(64, 48), (200, 300)], [(28, 28), (1000, 37), (448, 448)]])
def test_render_matches_the_hf_processor(client, hf, sizes):
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    body = client.post("/v1/chat/completions/render", json=_chat("What?", images)).json()
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": "What?"}]}]
    prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = hf(text=[prompt], images=images, return_tensors="np")
    assert body["token_ids"] == expected["input_ids"][0].tolist()
    features = body["features"]
    rows = 0
    for index, (width, height) in enumerate(sizes):
        kwargs = item_from_b64(features["kwargs_data"]["image"][index])
        metadata = item_from_b64(features["mm_metadata"]["image"][index])
        grid = kwargs["image_grid_thw"].data
        h, w = smart_resize(height, width)
        assert grid.tolist() == [1, h // 14, w // 14]
        assert features["mm_placeholders"]["image"][index]["length"] == h * w // (28 * 28)
        pixels = kwargs["pixel_values"].data
        assert pixels.shape == (h * w // (14 * 14), 3 * 2 * 14 * 14) and pixels.dtype == np.uint8
        if (h, w) == (height, width):  # no resize: the HF PIL processor sees the same pixels
            normalised = normalize_pixels(torch.from_numpy(pixels.copy()), NormParams.from_config(hf.image_processor
                                                                                                  .to_dict()))
            assert np.allclose(normalised.numpy(), expected["pixel_values"][rows:rows + len(pixels)], atol=2e-6)
        assert kwargs["pixel_values"].field.kind == "flat" and kwargs["image_grid_thw"].field.keep_on_cpu
        assert list(metadata) == ["image_grid_thw"] and np.array_equal(metadata["image_grid_thw"].data, grid)
        rows += len(pixels)
    assert np.array_equal(np.stack([item_from_b64(k)["image_grid_thw"].data
                                    for k in features["kwargs_data"]["image"]]), expected["image_grid_thw"])


def test_golden_vector_is_the_metadata_of_a_4x4_grid(client):
    body = client.post("/v1/chat/completions/render", json=_chat("x", [noise_image(56, 56)])).json()
    assert body["features"]["mm_metadata"] == {"image": [GOLDEN]}


def test_completions_render_is_a_list(client):
    reply = client.post("/v1/completions/render", json={"prompt": ["Hello", "World"], "max_tokens": 3})
    assert reply.status_code == 200
    bodies = reply.json()
    assert [len(b["token_ids"]) > 0 for b in bodies] == [True, True]
    assert bodies[0]["request_id"] != bodies[1]["request_id"]


def test_tokenize_detokenize_models(client, service):
    tokens = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == service.tokenizer.encode("Hello world") and tokens["count"] == len(tokens["tokens"])
    chat_tokens = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}],
                                                 "return_token_strs": True}).json()
    assert chat_tokens["tokens"] == HELLO_IDS and chat_tokens["token_strs"][0] == "<|im_start|>"
    assert client.post("/detokenize", json={"tokens": HELLO_IDS[11:15]}).json() == {"prompt": "<|im_start|>user\nHello"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert client.post("/detokenize", json={"tokens": [1], "model": "other"}).status_code == 404


def test_bad_bodies_are_400(client):
    assert client.post("/v1/chat/completions/render", content=b"{nope").status_code == 400
    reply = client.post("/v1/chat/completions/render", json={"messages": []})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "messages: must not be empty"
    reply = client.post("/v1/chat/completions/derender", json={"generate_response": {
        "request_id": "x", "choices": [{"token_ids": [1]}]}, "stream": True, "stream_state": {
        "id": "c", "created": 1, "model": "m", "outputs": [{"window": [1], "read": 2}]}})
    assert reply.status_code == 400
    assert "read (2) exceeds the window length (1)" in reply.json()["error"]["message"]
