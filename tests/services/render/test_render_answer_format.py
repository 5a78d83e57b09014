"""Render's answer-format extensions: mm_metadata as JSON number arrays, placeholders with is_embed."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from services.protocol.metadata_json import json_to_b64
from services.render.api_router import routes
from services.render.serving import RenderService
from tests.support.images import data_url, noise_image

RENDER = "/v1/chat/completions/render"


@pytest.fixture(scope="module")
def client(demo_model_path):
    service = RenderService(demo_model_path, "epd-demo")
    with TestClient(Starlette(routes=routes(service))) as test_client:
        yield test_client
    service.close()


def _chat(images, **extra):
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "x"}]}], **extra}


def test_json_metadata_and_is_embed_on_request_only(client):
    images = [noise_image(56, 56, 1), noise_image(84, 56, 2)]
    plain = client.post(RENDER, json=_chat(images), headers={"X-Request-Id": "r1"}).json()
    asked = client.post(RENDER, json=_chat(images, mm_metadata_format="json", return_is_embed=True),
                        headers={"X-Request-Id": "r1"}).json()
    assert asked["features"]["mm_metadata"] == {"image": [{"image_grid_thw": [1, 4, 4]},
                                                          {"image_grid_thw": [1, 4, 6]}]}
    assert [json_to_b64(e) for e in asked["features"]["mm_metadata"]["image"]] == \
        plain["features"]["mm_metadata"]["image"]
    assert asked["features"]["mm_placeholders"] == {"image": [
        {**p, "is_embed": [True] * p["length"]} for p in plain["features"]["mm_placeholders"]["image"]]}
    assert [p["length"] for p in plain["features"]["mm_placeholders"]["image"]] == [4, 6]
    assert all(set(p) == {"offset", "length"} for p in plain["features"]["mm_placeholders"]["image"])
    assert {k: v for k, v in asked.items() if k != "features"} == {k: v for k, v in plain.items() if k != "features"}
    assert asked["features"]["kwargs_data"] == plain["features"]["kwargs_data"]


def test_unknown_metadata_format_is_a_400(client):
    reply = client.post(RENDER, json=_chat([noise_image(56, 56)], mm_metadata_format="yaml"))
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request"
    assert "mm_metadata_format" in reply.json()["error"]["message"]


@pytest.mark.parametrize("flags", [{"mm_payload": "none"}, {"return_mm_kwargs": False},
                                   {"return_mm_kwargs": False, "mm_payload": "none"}])
def test_vllms_mm_payload_none_leaves_out_every_tensor(client, flags):
    images = [noise_image(56, 56, 1)]
    plain = client.post(RENDER, json=_chat(images), headers={"X-Request-Id": "r2"}).json()
    bare = client.post(RENDER, json=_chat(images, **flags), headers={"X-Request-Id": "r2"}).json()
    assert bare["features"] == {**plain["features"], "kwargs_data": None, "mm_metadata": None}
    assert {k: v for k, v in bare.items() if k != "features"} == {k: v for k, v in plain.items() if k != "features"}


def test_mm_payload_set_wins_over_the_deprecated_alias(client):
    body = _chat([noise_image(56, 56, 1)], mm_payload="tensors", return_mm_kwargs=False)
    features = client.post(RENDER, json=body).json()["features"]
    assert features["kwargs_data"]["image"][0] and features["mm_metadata"]["image"][0]


def test_metadata_payload_is_a_prefills_view_with_the_requests_handles(client):
    images = [noise_image(56, 56, 1)]
    plain = client.post(RENDER, json=_chat(images), headers={"X-Request-Id": "r3"}).json()
    handles = {plain["features"]["mm_hashes"]["image"][0]: {"backend": "shm", "key": "k"}}
    view = client.post(RENDER, json=_chat(images, mm_payload="metadata", ec_transfer_params=handles),
                       headers={"X-Request-Id": "r3"}).json()
    assert view["features"] == {**plain["features"], "kwargs_data": None}
    assert view["ec_transfer_params"] == handles and plain["ec_transfer_params"] is None
    reply = client.post(RENDER, json=_chat(images, mm_payload="metadata"))
    assert reply.status_code == 400 and reply.json()["error"] == {
        "message": "mm_payload 'metadata' needs ec_transfer_params (the EC handles of the images): a "
                   "metadata-only answer is what a prefill takes",
        "type": "invalid_request_error", "code": "missing_ec_transfer_params"}
    text_only = {"messages": [{"role": "user", "content": "hi"}], "mm_payload": "metadata"}
    assert client.post(RENDER, json=text_only).json()["features"] is None
