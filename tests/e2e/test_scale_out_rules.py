"""Every PROTOCOL.md validator, at every service that takes a GenerateRequest: exact status and message."""

from __future__ import annotations

import base64

import msgpack
import pytest

from tests.support.images import chat, data_url, noise_image
from tests.support.scale_out import Orchestrator, metadata_only

GOLDEN = ("ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAABAAAAAAAAAAEAAAAAAAAAKVmaWVsZJKnYmF0Y2hl"
          "ZIGra2VlcF9vbl9jcHXD")
TARGETS = ("coordinator", "encode", "prefill", "decode")
IDS = list(range(100, 108))


def _features(**changes):
    return {"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 4}]},
            "kwargs_data": {"image": [GOLDEN]}, **changes}


RULES = {
    "features_and_content_parts": (
        {"features": _features(), "content_parts": [{"type": "image_url", "url": "data:image/png;base64,AA=="}]},
        "content_parts and features are mutually exclusive"),
    "metadata_only_without_ec": (
        {"features": _features(kwargs_data=None, mm_metadata={"image": [GOLDEN]})},
        "metadata-only multimodal items require ec_transfer_params"),
    "modality_keys": (
        {"features": _features(mm_metadata={"video": [GOLDEN]})},
        "features: modality keys differ: mm_hashes ['image'], mm_placeholders ['image'], kwargs_data ['image'], "
        "mm_metadata ['video']"),
    "list_lengths": (
        {"features": _features(mm_metadata={"image": [GOLDEN, GOLDEN]})},
        "features: modality 'image' has list lengths that differ: mm_hashes 1, mm_placeholders 1, kwargs_data 1, "
        "mm_metadata 2"),
    "overlapping_placeholders": (
        {"features": {"mm_hashes": {"image": ["a", "b"]}, "mm_placeholders": {"image": [
            {"offset": 1, "length": 4}, {"offset": 3, "length": 2}]}}},
        "features: mm_placeholders: ranges overlap: image[0] covers [1, 5) and image[1] covers [3, 5)"),
    "placeholder_out_of_range": (
        {"features": _features(mm_placeholders={"image": [{"offset": 6, "length": 4}]})},
        "features.mm_placeholders.image[0]: offset+length (10) exceeds len(token_ids) (8)"),
    "negative_offset": (
        {"features": _features(mm_placeholders={"image": [{"offset": -1, "length": 4}]})},
        "features.mm_placeholders.image[0].offset: must be >= 0"),
    "negative_token_id": ({"token_ids": [-1, 2]}, "token_ids[0]: must be >= 0"),
    "empty_token_ids": ({"token_ids": []}, "token_ids: must not be empty"),
    "empty_cache_salt": ({"cache_salt": ""}, "cache_salt: must be a non-empty string"),
    "long_cache_salt": ({"cache_salt": "s" * 129}, "cache_salt: must be at most 128 characters and must not "
                        "contain '@', '/', '\\', or NUL"),
    "nested_kv_not_an_object": ({"sampling_params": {"extra_args": {"kv_transfer_params": 5}}},
                                "sampling_params.extra_args.kv_transfer_params: must be an object"),
}


@pytest.fixture(scope="module")
def orch(shm_cluster):
    orchestrator = Orchestrator(shm_cluster)
    yield orchestrator
    orchestrator.close()


def _error(reply, status=400):
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_validator(orch, target, rule):
    change, message = RULES[rule]
    body = {"token_ids": IDS, "sampling_params": {"max_tokens": 2}, **change}
    error = _error(orch.post(target, "/inference/v1/generate", body))
    assert error["message"] == message
    assert error["type"] == "invalid_request_error"


def _ext_item(ext_type: int) -> str:
    payload = {"image_grid_thw": {"data": ["int64", [3], msgpack.ExtType(ext_type, b"\0" * 24)],
                                  "field": ["batched", {"keep_on_cpu": True}]}}
    return base64.b64encode(msgpack.packb(payload, use_bin_type=True)).decode()


@pytest.mark.parametrize("ext_type", [1, 2, 7])
def test_extension_types_other_than_3_are_refused(orch, ext_type):
    generate = orch.render(chat("x", [noise_image(56, 56, 40)]))
    bad = _ext_item(ext_type)
    with_kwargs = {**generate, "features": {**generate["features"], "kwargs_data": {"image": [bad]}}}
    for target in ("encode", "coordinator"):
        error = _error(orch.post(target, "/inference/v1/generate", with_kwargs))
        assert "extension type" in error["message"] and str(ext_type) in error["message"], error
    light = metadata_only(generate)
    light["features"]["mm_metadata"] = {"image": [bad]}
    light["ec_transfer_params"] = {generate["features"]["mm_hashes"]["image"][0]: {"any": 1}}
    error = _error(orch.post("prefill", "/inference/v1/generate", light))
    assert error["message"].startswith("features.mm_metadata.image[0]: "), error


def test_golden_vector_is_what_render_answers_for_a_4x4_grid(orch):
    """A 56x56 image is grid (1, 4, 4): render's mm_metadata is the golden vector byte for byte."""
    generate = orch.render(chat("x", [noise_image(56, 56, 41)]))
    assert generate["features"]["mm_metadata"] == {"image": [GOLDEN]}
    assert generate["features"]["mm_placeholders"]["image"][0]["length"] == 4
    # and prefill takes it as is
    ec = orch.encode(generate)["ec_transfer_params"]
    prefill = orch.ok("prefill", "/inference/v1/generate", orch.prefill_body(generate, ec))
    assert len(prefill["choices"][0]["token_ids"]) == 1


def test_unknown_model_is_refused_everywhere(orch):
    for target in TARGETS:
        error = _error(orch.post(target, "/inference/v1/generate", {"token_ids": IDS, "model": "gpt-17"}), 404)
        assert error["message"].startswith("The model `gpt-17` does not exist"), (target, error)
        assert error["code"] == "model_not_found", (target, error)


def test_role_specific_rules(orch):
    assert _error(orch.post("decode", "/inference/v1/generate", {"token_ids": IDS}))["message"] == \
        "decode needs kv_transfer_params (from a prefill answer)"
    assert _error(orch.post("encode", "/inference/v1/generate", {"token_ids": IDS}))["message"] == \
        "encode needs features with at least one multimodal item"
    streamed = _error(orch.post("prefill", "/inference/v1/generate", {"token_ids": IDS, "stream": True}))
    assert streamed["code"] == "stream_not_supported"
    parts = {"token_ids": IDS, "content_parts": [{"type": "image_url", "url": "data:image/png;base64,AA=="}]}
    assert _error(orch.post("prefill", "/inference/v1/generate", parts))["code"] == "no_vision_encoder"
    assert _error(orch.post("encode", "/inference/v1/generate", parts))["code"] == "content_parts_not_supported"
    out_of_vocab = _error(orch.post("prefill", "/inference/v1/generate", {"token_ids": [1, 10**9]}))
    assert out_of_vocab["code"] == "invalid_token_id"
    bad_kv = _error(orch.post("decode", "/inference/v1/generate", {"token_ids": IDS, "kv_transfer_params": {}}))
    assert bad_kv["message"].startswith("kv_transfer_params: missing or bad field")


def test_content_parts_follow_the_chat_media_policy(orch):
    url = "http://127.0.0.1:9/cat.png"
    via_chat = _error(orch.post("coordinator", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}))
    via_parts = _error(orch.post("coordinator", "/inference/v1/generate", {
        "token_ids": [151652, 151655, 151653], "content_parts": [{"type": "image_url", "url": url}]}))
    assert via_parts["code"] == via_chat["code"] == "media_url_forbidden"
    assert via_parts["message"] == via_chat["message"]


def test_content_part_uuid_names_the_item_scoped_by_model_and_salt(orch):
    """A uuid given with a content part names the item (never as is: scoped by model and cache_salt, see
    docs/security.md): encode later finds the embedding under the key render reports for that uuid."""
    image = noise_image(56, 56, 42)
    rendered = orch.render(chat("x", [image], max_tokens=3, temperature=0))
    uuid = "caller-chosen-id-42"
    with_uuid = chat("x", [image], max_tokens=3, temperature=0)
    with_uuid["messages"][0]["content"][0]["uuid"] = uuid
    key = orch.render(with_uuid)["features"]["mm_hashes"]["image"][0]
    assert key not in (uuid, rendered["features"]["mm_hashes"]["image"][0])
    part = {"type": "image_url", "url": data_url(image), "uuid": uuid}
    sampling = {"max_tokens": 3, "temperature": 0}
    first = orch.ok("coordinator", "/inference/v1/generate",
                    {"token_ids": rendered["token_ids"], "content_parts": [part], "sampling_params": sampling})
    by_hash = {"token_ids": rendered["token_ids"], "features": {
        "mm_hashes": {"image": [key]}, "mm_placeholders": rendered["features"]["mm_placeholders"],
        "kwargs_data": {"image": [None]}}}  # a null entry: resolve by hash from the encoder cache
    ec = orch.encode(by_hash)["ec_transfer_params"]
    assert list(ec) == [key]
    light = metadata_only(rendered)
    light["features"]["mm_hashes"] = {"image": [key]}
    second = orch.ok("coordinator", "/inference/v1/generate",
                     {**light, "ec_transfer_params": ec, "sampling_params": sampling})
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
