"""An external orchestrator drives the roles over HTTP only and gets the coordinator's answers exactly.

render -> encode (kwargs_data) -> prefill (metadata-only features + ec_transfer_params) -> decode
(kv_transfer_params) -> derender, against role processes started by `epd serve`; and the coordinator's
own /inference/v1/generate on its three input paths (features, content_parts, token_ids only).
"""

from __future__ import annotations

import pytest

from tests.support.images import chat, data_url, noise_image
from tests.support.scale_out import Orchestrator, metadata_only

IMAGE_PAD = 151655
MAX_TOKENS = 16
CASES = {
    "text": ("Tell me a story about a lighthouse.", []),
    "one_image": ("Describe this image.", [(64, 48, 1)]),
    "two_images": ("Compare these two images.", [(56, 84, 2), (112, 56, 3)]),
}


@pytest.fixture(scope="module")
def orch(shm_cluster):
    orchestrator = Orchestrator(shm_cluster)
    yield orchestrator
    orchestrator.close()


def _images(spec):
    return [noise_image(w, h, seed) for w, h, seed in spec]


def _tokens(answer):
    return answer["choices"][0]["token_ids"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_orchestrated_flow_equals_the_coordinator(orch, case):
    text, spec = CASES[case]
    body = chat(text, _images(spec), max_tokens=MAX_TOKENS, temperature=0)
    trace = orch.run(body)
    direct = orch.ok("coordinator", "/v1/chat/completions", {**body, "return_token_ids": True})
    assert trace.chat["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert trace.chat["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert trace.chat["usage"] == direct["usage"]
    assert trace.generate["token_ids"] == direct["prompt_token_ids"]
    assert _tokens(trace.decode) == direct["choices"][0]["token_ids"]
    # prefill answers the first token (decode's first) and what decode must carry
    assert _tokens(trace.prefill) == _tokens(trace.decode)[:1]
    assert trace.prefill["choices"][0]["finish_reason"] in ("length", "stop")
    assert trace.prefill["kv_transfer_params"]
    if spec:
        hashes = trace.generate["features"]["mm_hashes"]["image"]
        assert len(hashes) == len(spec)
        assert set(trace.encode["ec_transfer_params"]) == set(hashes)
        assert all(trace.encode["ec_transfer_params"].values())
    else:
        assert trace.generate["features"] is None


def test_prefill_refuses_metadata_only_items_without_ec_transfer_params(orch):
    generate = orch.render(chat("What is it?", [noise_image(56, 56, 4)], max_tokens=4))
    reply = orch.post("prefill", "/inference/v1/generate", orch.prefill_body(generate, None))
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "metadata-only multimodal items require ec_transfer_params"


def test_pixels_without_a_handle_are_encoded_by_prefill_only_when_stored_nowhere(orch):
    """An image sent to prefill with its pixels and no EC handle is looked up by mm_hash (a shm prefill sees no
    encoder's entries), then encoded by prefill itself: its first token is the coordinator's."""
    body = chat("What is it?", [noise_image(56, 56, 4)], max_tokens=4, temperature=0)
    generate = orch.render(body)
    inline = orch.metric("prefill", "epd_prefill_inline_encoded_items_total")
    reply = orch.post("prefill", "/inference/v1/generate", {**generate, "sampling_params": {
        **generate["sampling_params"], "max_tokens": 1}, "kv_transfer_params": {"do_remote_decode": True}})
    assert reply.status_code == 200, reply.text
    assert orch.metric("prefill", "epd_prefill_inline_encoded_items_total") == inline + 1
    expected = orch.ok("coordinator", "/v1/chat/completions", {**body, "return_token_ids": True})
    assert reply.json()["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"][:1]


def test_three_input_paths_give_identical_tokens(orch):
    images = [noise_image(56, 84, 7), noise_image(84, 56, 8)]
    body = chat("Compare.", images, max_tokens=12, temperature=0)
    via_chat = orch.ok("coordinator", "/v1/chat/completions", {**body, "return_token_ids": True})
    rendered = orch.render(body)
    via_features = orch.ok("coordinator", "/inference/v1/generate", rendered)  # posted unchanged
    parts = [{"type": "image_url", "url": data_url(image)} for image in images]
    sampling = rendered["sampling_params"]
    via_parts = orch.ok("coordinator", "/inference/v1/generate", {
        "token_ids": _collapse_pad_runs(rendered["token_ids"]), "content_parts": parts, "sampling_params": sampling})
    via_expanded = orch.ok("coordinator", "/inference/v1/generate", {
        "token_ids": rendered["token_ids"], "content_parts": parts, "sampling_params": sampling})
    expected = via_chat["choices"][0]["token_ids"]
    assert _tokens(via_features) == _tokens(via_parts) == _tokens(via_expanded) == expected
    assert via_features["usage"] == via_parts["usage"] == via_chat["usage"]


def test_token_ids_only_path_equals_chat(orch):
    body = chat("Tell me about the sea.", max_tokens=10, temperature=0)
    via_chat = orch.ok("coordinator", "/v1/chat/completions", {**body, "return_token_ids": True})
    via_ids = orch.ok("coordinator", "/inference/v1/generate", {
        "token_ids": via_chat["prompt_token_ids"], "sampling_params": {"max_tokens": 10, "temperature": 0}})
    assert _tokens(via_ids) == via_chat["choices"][0]["token_ids"]
    assert via_ids["request_id"].startswith("generate-tokens-")


def test_features_path_stores_pixels_once_and_sends_encode_a_handle(orch):
    rendered = orch.render(chat("Look.", [noise_image(224, 224, 31)], max_tokens=2))
    before = {role: orch.metric(role, f"epd_{role}_mm_bytes_received_total") for role in ("encode", "prefill")}
    stored_before = orch.metric("coordinator", "epd_mm_store_bytes_copied_total")
    orch.ok("coordinator", "/inference/v1/generate", rendered)
    encode = orch.metric("encode", "epd_encode_mm_bytes_received_total") - before["encode"]
    prefill = orch.metric("prefill", "epd_prefill_mm_bytes_received_total") - before["prefill"]
    stored = orch.metric("coordinator", "epd_mm_store_bytes_copied_total") - stored_before
    # pixel_values (256, 1176) raw uint8 = 301,056 bytes (vLLM's form) + the grid, stored once
    assert stored == 256 * 1176 + 24, stored
    assert 0 < encode < 2_000, encode           # the item's skeleton and handle
    assert 0 < prefill < 2_000, prefill         # image_grid_thw only


def test_coordinator_uses_the_callers_ec_transfer_params(orch):
    body = chat("Again.", [noise_image(56, 112, 32)], max_tokens=6, temperature=0)
    rendered = orch.render(body)
    ec = orch.encode(rendered)["ec_transfer_params"]
    encoded = orch.metric("encode", "epd_encode_items_total")
    light = {**metadata_only(rendered), "ec_transfer_params": ec}
    via_handles = orch.ok("coordinator", "/inference/v1/generate", light)
    assert orch.metric("encode", "epd_encode_items_total") == encoded  # encode was not called
    assert _tokens(via_handles) == _tokens(orch.ok("coordinator", "/inference/v1/generate", rendered))


def test_transfer_params_nested_in_extra_args(orch):
    generate = orch.render(chat("Nested.", [noise_image(56, 56, 33)], max_tokens=5, temperature=0))
    ec = orch.encode(generate)["ec_transfer_params"]
    body = orch.prefill_body(generate, None)
    body["sampling_params"]["extra_args"] = {"ec_transfer_params": ec}
    prefill = orch.ok("prefill", "/inference/v1/generate", body)
    kv = prefill["kv_transfer_params"]
    nested = orch.decode_body(generate, None)
    nested["sampling_params"] = {**generate["sampling_params"], "extra_args": {"kv_transfer_params": kv}}
    decoded = orch.ok("decode", "/inference/v1/generate", nested)
    assert _tokens(decoded)[:1] == _tokens(prefill)
    # top level wins over a bogus nested value
    again = orch.ok("prefill", "/inference/v1/generate", {**body, "ec_transfer_params": ec, "sampling_params": {
        **body["sampling_params"], "extra_args": {"ec_transfer_params": {"bogus": {}}}}})
    assert _tokens(again) == _tokens(prefill)
    top = orch.decode_body(generate, again["kv_transfer_params"])
    top["sampling_params"] = {**generate["sampling_params"], "extra_args": {"kv_transfer_params": {"handle": 1}}}
    assert _tokens(orch.ok("decode", "/inference/v1/generate", top)) == _tokens(decoded)


def test_x_request_id_names_the_response(orch):
    generate = orch.render(chat("Ids.", max_tokens=3, temperature=0))
    headers = {"X-Request-Id": "orchestrator-42"}
    prefill = orch.ok("prefill", "/inference/v1/generate", orch.prefill_body(generate, None), headers=headers)
    assert prefill["request_id"] == "generate-tokens-orchestrator-42"
    decoded = orch.ok("decode", "/inference/v1/generate", orch.decode_body(generate, prefill["kv_transfer_params"]),
                      headers=headers)
    assert decoded["request_id"] == "generate-tokens-orchestrator-42"
    via = orch.ok("coordinator", "/inference/v1/generate", generate, headers={"X-Request-Id": "coord-7"})
    assert via["request_id"] == "generate-tokens-coord-7"
    plain = orch.ok("coordinator", "/inference/v1/generate", generate)
    assert plain["request_id"] == "generate-tokens-" + generate["request_id"]


def test_cluster_lists_every_instance(orch):
    listing = orch.http.get(orch.cluster.url + "/cluster").json()
    instances = listing["instances"]
    assert {i["role"] for i in instances} == {"render", "encode", "prefill", "decode"}
    for instance in instances:
        assert set(instance) == {"role", "http_url", "grpc_address", "healthy"}
        assert instance["healthy"] is True
        assert orch.http.get(instance["http_url"] + "/health").status_code == 200
    assert {i["http_url"] for i in instances} == {"http://" + h for _, h, _ in orch.cluster.roles}


def _collapse_pad_runs(token_ids):
    """The template's form: one image_pad per image (content_parts accepts it and sizes the runs)."""
    out = []
    for token in token_ids:
        if not (token == IMAGE_PAD and out and out[-1] == IMAGE_PAD):
            out.append(token)
    return out
