"""0 pixel bytes through the coordinator's gRPC: render stores each image once, encode reads it by handle.

Checked three ways on a real cluster: the coordinator's own counter of kwargs_data bytes per hop, the
RenderResponse itself (its items decode to skeletons holding 0 tensor bytes), and the vLLM-compatible HTTP
surfaces, which still carry the whole item (render's answer as base64) and, posted to the coordinator's
/inference/v1/generate, are stored once there and then travel by handle, with the same tokens as chat.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import httpx
import pytest

from services.connectors.mm import MmRef
from services.protocol.items import item_payload_nbytes
from services.protocol.serialization import decode_item, item_from_b64
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc
from tests.support.cluster import metric_value
from tests.support.images import chat, noise_image

PIXELS_224 = 256 * 1176      # a 224x224 image: (256, 1176) uint8 patches (vLLM's form)
SKELETON = 118                # its item without tensor data: field settings only
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _documented(hop: str) -> int:
    """The bold figure of `hop`'s row in docs/architecture.md's "What crosses which hop" table."""
    row = next(line for line in ARCHITECTURE.read_text().splitlines() if line.startswith(f"| {hop} |"))
    return int(re.search(r"\*\*([\d,]+)\*\*", row).group(1).replace(",", ""))


def test_the_documented_sizes_are_the_measured_ones():
    assert _documented("render → mm store") == PIXELS_224 + 24
    assert _documented("render → coordinator → encode") == SKELETON
    assert _documented("mm store → encode") == 0


def _hop_bytes(cluster) -> dict[str, float]:
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    return {hop: metric_value(text, "epd_coordinator_mm_payload_bytes_total", f'hop="{hop}"')
            for hop in ("render", "encode", "prefill")}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("cluster_name", ["shm_cluster", "redis_cluster"])
def test_the_coordinator_moves_no_pixel_bytes(request, cluster_name):
    cluster = request.getfixturevalue(cluster_name)
    before = _hop_bytes(cluster)
    copied = {role: metric_value(cluster.metrics(role), "epd_mm_store_bytes_copied_total") for role in ("render",
                                                                                                       "encode")}
    seed = 811 if cluster_name == "shm_cluster" else 813
    body = chat("What?", [noise_image(224, 224, seed=seed), noise_image(224, 224, seed=seed + 1)], max_tokens=2)
    with cluster.client() as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    moved = _delta(_hop_bytes(cluster), before)
    stored = metric_value(cluster.metrics("render"), "epd_mm_store_bytes_copied_total") - copied["render"]
    read = metric_value(cluster.metrics("encode"), "epd_mm_store_bytes_copied_total") - copied["encode"]
    # shm copies each image into the pool once; redis sends it from the arrays; encode's views copy nothing
    # (redis: received straight into the tensors' buffer)
    assert stored == (2 * _documented("render → mm store") if cluster_name == "shm_cluster" else 0), stored
    assert read == 0, read
    assert moved["render"] == 2 * SKELETON, moved                                      # two skeletons
    assert moved["encode"] == 2 * SKELETON, moved                                      # and on to encode
    assert moved["prefill"] == 0, moved                                                # metadata only

    address = [g for r, _, g in cluster.roles if r == "render"][0]
    with grpc.insecure_channel(address) as channel:
        reply = rpc.RenderServiceStub(channel).RenderChat(
            pb.RenderChatRequest(request_id="direct", chat_request_json=json.dumps(body).encode()), timeout=30)
    for item in reply.items:
        skeleton = decode_item(item.kwargs_data)
        assert item_payload_nbytes(skeleton) == 0 and skeleton["pixel_values"].data is None  # 0 pixel bytes
        ref = MmRef.from_json(item.kwargs_ref_json)
        assert set(ref.keys) == {"pixel_values", "image_grid_thw"}  # in the processor's (vLLM's) key order
        assert {t["name"]: t["nbytes"] for t in ref.handle["tensors"]} == {"pixel_values": PIXELS_224,
                                                                          "image_grid_thw": 24}
    assert sum(len(i.kwargs_data) for i in reply.items) == moved["render"]  # the counter counts exactly that
    assert all(len(i.kwargs_data) == SKELETON for i in reply.items)


def test_a_features_request_is_stored_once_then_travels_by_handle(shm_cluster):
    image = noise_image(224, 224, seed=821)
    body = chat("Say.", [image], max_tokens=6, temperature=0)
    render_url = shm_cluster.http_urls("render")[0]
    rendered = httpx.post(render_url + "/v1/chat/completions/render", json=body, timeout=60).json()
    [kwargs_b64] = rendered["features"]["kwargs_data"]["image"]
    assert item_payload_nbytes(item_from_b64(kwargs_b64)) == PIXELS_224 + 24  # the HTTP answer: whole item
    before = _hop_bytes(shm_cluster)
    rendered["sampling_params"] = {"max_tokens": 6, "temperature": 0}
    with shm_cluster.client() as client:
        generated = client.post("/inference/v1/generate", json=rendered)
        by_chat = client.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
    assert generated.status_code == 200, generated.text
    moved = _delta(_hop_bytes(shm_cluster), before)
    assert moved["encode"] == SKELETON, moved  # the chat request's item was known: only the features' one
    assert generated.json()["choices"][0]["token_ids"] == by_chat["choices"][0]["token_ids"]
