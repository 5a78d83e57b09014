"""Bad input gets a 400 with an OpenAI-style error naming the problem; the cluster keeps serving."""

from __future__ import annotations

import base64

import pytest

from tests.support.images import chat, data_url, encode, noise_image

MODEL = "epd-demo-qwen2-vl"


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _with_parts(*parts: dict, **extra) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}], **extra}


def _big_flat_png(width: int, height: int) -> str:
    from PIL import Image

    return "data:image/png;base64," + base64.b64encode(encode(Image.new("RGB", (width, height)))).decode()


CASES = [
    ("malformed_json", b"{not json", "malformed JSON"),
    ("missing_messages", {"model": MODEL}, "messages"),
    ("undecodable_image", _with_parts(_image_part("data:image/png;base64," + base64.b64encode(
        b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode())), "image"),
    ("data_url_not_image", _with_parts(_image_part("data:text/plain;base64,aGVsbG8gd29ybGQ=")), "image"),
    ("invalid_base64", _with_parts(_image_part("data:image/png;base64,@@@not-base64@@@")), "base64"),
    ("too_many_pixels", _with_parts(_image_part(_big_flat_png(5000, 4000))), "pixels"),
    ("too_many_bytes", _with_parts(_image_part(data_url(noise_image(700, 700, 9)))), "bytes"),
    ("too_many_images", _with_parts(*[_image_part(data_url(noise_image(28, 28, i))) for i in range(5)]), "images"),
    ("max_tokens_zero", chat("hi", max_tokens=0), "max_tokens"),
    ("max_tokens_negative", chat("hi", max_tokens=-3), "max_tokens"),
    ("max_tokens_beyond_context", chat("hi", max_tokens=100_000), "context"),
    ("messages_not_a_list", {"messages": "hello"}, "messages"),
    ("body_not_an_object", [1, 2, 3], "object"),
    ("loopback_image_url", _with_parts(_image_part("http://127.0.0.1:9/cat.png")), "127.0.0.1"),
    ("file_url", _with_parts(_image_part("file:///etc/passwd")), "scheme"),
    # checked by the coordinator while render already works on the image (render alone would take "yes")
    ("stream_not_a_boolean", _with_parts(_image_part(data_url(noise_image(224, 224, 31))), stream="yes"),
     "stream: must be a boolean"),
]


@pytest.mark.parametrize("name,body,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_400_naming_the_problem(shm_cluster, name, body, needle):
    with shm_cluster.client() as client:
        if isinstance(body, bytes):
            reply = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["type"] == "invalid_request_error"
    assert needle.lower() in error["message"].lower(), error


def test_an_unknown_model_is_a_404_as_in_openai_and_vllm(shm_cluster):
    import openai

    for path, body in (("/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"model": "gpt-17", "prompt": "hi"})):
        with shm_cluster.client() as client:
            reply = client.post(path, json=body)
        assert reply.status_code == 404, (path, reply.text)
        assert reply.json()["error"] == {"message": f"The model `gpt-17` does not exist (served: {MODEL})",
                                         "type": "not_found_error", "code": "model_not_found"}, path
    client = openai.OpenAI(base_url=shm_cluster.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.status_code == 404 and "gpt-17" in caught.value.message


def test_cluster_keeps_serving_after_bad_input(shm_cluster):
    with shm_cluster.client() as client:
        for _, body, _ in CASES[:4]:
            client.post("/v1/chat/completions", json=body) if not isinstance(body, bytes) else None
        reply = client.post("/v1/chat/completions", json=chat("still there?", max_tokens=3))
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert client.get("/health").status_code == 200
