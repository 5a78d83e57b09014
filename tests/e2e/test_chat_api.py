"""The OpenAI surface of the coordinator: shapes, streaming, usage, seeds, http image URLs."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from tests.support.images import chat, encode, noise_image


def _sse(reply) -> list:
    events = []
    for line in reply.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_models_and_health(shm_cluster):
    with shm_cluster.client() as client:
        models = client.get("/v1/models").json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["epd-demo-qwen2-vl"]
        assert client.get("/health").json()["status"] == "ok"


def test_non_streaming_shape(shm_cluster):
    with shm_cluster.client() as client:
        body = client.post("/v1/chat/completions", json=chat("Hello", max_tokens=5, temperature=0)).json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "epd-demo-qwen2-vl"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}


def test_streaming_deltas_equal_the_whole_answer(shm_cluster):
    image = noise_image(112, 112, seed=7)
    request = chat("Describe.", [image], max_tokens=12, temperature=0)
    with shm_cluster.client() as client:
        whole = client.post("/v1/chat/completions", json=request).json()
        with client.stream("POST", "/v1/chat/completions",
                           json={**request, "stream": True, "stream_options": {"include_usage": True}}) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            events = _sse(reply)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_stream_without_usage_has_no_usage_chunk(shm_cluster):
    with shm_cluster.client() as client:
        with client.stream("POST", "/v1/chat/completions", json=chat("Hi", max_tokens=3, stream=True)) as reply:
            events = _sse(reply)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])
    assert all("usage" not in e for e in events[:-1])


def test_seed_makes_sampling_reproducible(shm_cluster):
    def sample(seed):
        body = chat("Write a poem.", max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, return_token_ids=True)
        with shm_cluster.client() as client:
            return client.post("/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_stop_string_and_max_tokens(shm_cluster):
    with shm_cluster.client() as client:
        free = client.post("/v1/chat/completions", json=chat("Go", max_tokens=12, temperature=0)).json()
        text = free["choices"][0]["message"]["content"]
        stop = text[len(text) // 2:][:3]
        if not stop.strip():
            pytest.skip("the random model produced whitespace only")
        stopped = client.post("/v1/chat/completions",
                              json=chat("Go", max_tokens=12, temperature=0, stop=[stop])).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["message"]["content"] == text[:text.index(stop)]


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_server():
    image = noise_image(140, 196, seed=11)
    _ImageHandler.payload = encode(image)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield image, f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    server.shutdown()


def test_http_image_url_gives_the_same_tokens_as_a_data_url(redis_cluster, image_server):
    image, url = image_server
    by_url = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]}],
        "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    with redis_cluster.client() as client:
        a = client.post("/v1/chat/completions", json=by_url).json()
        b = client.post("/v1/chat/completions",
                        json=chat("What?", [image], max_tokens=8, temperature=0, return_token_ids=True)).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["prompt_token_ids"] == b["prompt_token_ids"]


def test_loopback_url_refused_by_default(shm_cluster, image_server):
    _, url = image_server
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    with shm_cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "media_url_forbidden"
