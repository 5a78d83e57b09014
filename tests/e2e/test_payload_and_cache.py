"""Pixels go render -> mm store -> encode, never through the coordinator; prefill receives metadata; an image
is encoded once."""

from __future__ import annotations

import grpc

from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc
from tests.support.cluster import metric_value
from tests.support.images import chat, noise_image


def _mm_bytes(cluster, role):
    return metric_value(cluster.metrics(role), f"epd_{role}_mm_bytes_received_total")


def _encoded(cluster):
    return metric_value(cluster.metrics("encode"), "epd_encode_items_total", 'result="encoded"')


def _post(cluster, body):
    with cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_pixels_travel_by_handle_and_prefill_receives_no_pixel_data(shm_cluster):
    before = {role: _mm_bytes(shm_cluster, role) for role in ("encode", "prefill")}
    stored_before = metric_value(shm_cluster.metrics("render"), "epd_mm_store_bytes_copied_total")
    read_before = metric_value(shm_cluster.metrics("encode"), "epd_mm_store_bytes_copied_total")
    _post(shm_cluster, chat("What is this?", [noise_image(448, 448, seed=101)], max_tokens=2))
    encode_bytes = _mm_bytes(shm_cluster, "encode") - before["encode"]
    prefill_bytes = _mm_bytes(shm_cluster, "prefill") - before["prefill"]
    stored = metric_value(shm_cluster.metrics("render"), "epd_mm_store_bytes_copied_total") - stored_before
    assert stored == 1024 * 1176 + 3 * 8, stored       # (1024, 1176) uint8 pixels + grid, written once
    assert metric_value(shm_cluster.metrics("encode"), "epd_mm_store_bytes_copied_total") == read_before  # views
    assert 0 < encode_bytes < 2_000, encode_bytes       # the item's skeleton and handle, no pixels
    assert 0 < prefill_bytes < 2_000, prefill_bytes     # only image_grid_thw


def test_same_image_twice_is_encoded_once(shm_cluster):
    image = noise_image(224, 224, seed=202)
    before = _encoded(shm_cluster)
    first = _post(shm_cluster, chat("One.", [image], max_tokens=4, temperature=0))
    second = _post(shm_cluster, chat("One.", [image], max_tokens=4, temperature=0))
    assert _encoded(shm_cluster) - before == 1
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


def test_encode_role_answers_a_stored_item_from_its_cache(shm_cluster):
    """Calling encode directly twice with the same item: the second answer is a cache hit."""
    image = noise_image(56, 56, seed=303)
    rendered = _render(shm_cluster, chat("x", [image]))
    item = rendered.items[0]
    address = [g for r, _, g in shm_cluster.roles if r == "encode"][0]
    with grpc.insecure_channel(address) as channel:
        stub = rpc.EncodeServiceStub(channel)
        replies = [stub.Encode(pb.EncodeRequest(request_id=f"direct{i}", items=[item]), timeout=30) for i in range(2)]
    assert [r.items[0].cache_hit for r in replies] == [False, True]
    assert replies[0].items[0].handle_json == replies[1].items[0].handle_json


def _render(cluster, body):
    import json

    address = [g for r, _, g in cluster.roles if r == "render"][0]
    with grpc.insecure_channel(address) as channel:
        request = pb.RenderChatRequest(request_id="r", chat_request_json=json.dumps(body).encode())
        return rpc.RenderServiceStub(channel).RenderChat(request, timeout=30)
