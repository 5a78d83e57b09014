"""Adjacent stages handing over for real, in one process: render -> encode -> prefill -> decode, each stage's own
service core (the same code the role processes run) over real shm stores, one image prompt on the demo model.

Each hand-off is checked where it happens, against Hugging Face on the same checkpoint: encode's embedding of the
item render stored by handle is the tower's output on the pixels HF is fed; prefill's first token from that
embedding (by EC handle, no pixels) is HF's first greedy token; decode's tokens from prefill's KV entry are the
rest of HF `generate`'s.  The full path through real processes is tests/e2e; these say which pair broke.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from tests.support.images import data_url, noise_image

TEXT, MAX_TOKENS = "What is in this picture?", 8


@pytest.fixture(scope="module")
def stores():
    from services.connectors import StoreConfig, create_store

    instance = "flow" + uuid.uuid4().hex[:8]
    made = {purpose: create_store(StoreConfig("shm", purpose, instance, capacity_bytes=64 << 20))
            for purpose in ("mm", "ec", "kv")}
    yield made
    for store in made.values():
        store.close()


@pytest.fixture(scope="module")
def image():
    return noise_image(224, 224, seed=6061)


@pytest.fixture(scope="module")
def rendered(demo_model_path, stores, image):
    """Render's prompt and its items, stored by handle in the mm store (what the coordinator carries on)."""
    from services.protocol.openai import ChatCompletionRequest
    from services.render.servicer import by_handle
    from services.render.serving import RenderService

    service = RenderService(demo_model_path, "m")
    request = ChatCompletionRequest.model_validate({"model": "m", "max_tokens": MAX_TOKENS, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                     {"type": "text", "text": TEXT}]}]})
    try:
        prompt = asyncio.run(service.render_chat(request))
    finally:
        service.close()
    return prompt, by_handle(prompt, stores["mm"])


@pytest.fixture(scope="module")
def reference(demo_model_path, image):
    from tests.support.reference import Reference

    ref = Reference(demo_model_path)
    return ref, ref.greedy(TEXT, [image], MAX_TOKENS)


@pytest.fixture(scope="module")
def encoded(demo_model_path, stores, rendered):
    from services.connectors.mm import MmRef
    from services.encode.engine import EncodeEngine
    from services.encode.serving import EncodeService
    from services.models.registry import adapter_for
    from services.protocol.serialization import decode_item

    vision = adapter_for(demo_model_path).load_vision(demo_model_path)
    _, [item] = rendered
    with EncodeEngine(vision, max_batch_tokens=16384) as engine:
        service = EncodeService(engine, stores["ec"], "m", timeout_s=60, mm_store=stores["mm"])
        result = asyncio.run(service.encode(item.mm_hash, decode_item(item.kwargs_data),
                                            MmRef.from_json(item.kwargs_ref_json)))
    return vision, result


@pytest.fixture(scope="module")
def prefilled(demo_model_path, stores, rendered, encoded):
    from services.models.registry import adapter_for
    from services.prefill.engine import PrefillEngine
    from services.prefill.serving import PrefillItem, PrefillService
    from services.protocol.serialization import decode_item

    prompt, [item] = rendered
    lm = adapter_for(demo_model_path).load_language(demo_model_path)
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    service = PrefillService(engine, lm, stores["ec"], stores["kv"], "p0")
    items = [PrefillItem(item.modality, item.mm_hash, item.offset, item.length, decode_item(item.mm_metadata))]
    outcome = asyncio.run(service.prefill("flow-1", prompt.token_ids, items, {item.mm_hash: encoded[1].handle},
                                          {"temperature": 0.0}, None))
    engine.close()
    return lm, outcome


def test_render_to_encode_the_embedding_of_the_item_stored_by_handle_is_the_towers(reference, encoded, stores, image):
    """The pixels encode read by handle from the mm store are the ones HF is fed (vLLM's): the same embedding."""
    from tests.support.reference import _use_vllm_pixels

    ref, _ = reference
    vision, result = encoded
    inputs = ref.processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image], return_tensors="pt")
    _use_vllm_pixels(inputs, ref.processor, [image], ref.model_path)
    [expected] = vision.encode([{"pixel_values": inputs["pixel_values"],
                                 "image_grid_thw": inputs["image_grid_thw"][0]}])
    entry = stores["ec"].get(result.handle)
    torch.testing.assert_close(entry["embedding"], expected, rtol=0, atol=1e-5)
    assert not result.cache_hit


def test_encode_to_prefill_the_first_token_from_the_embedding_by_handle_is_hfs(reference, prefilled):
    _, greedy = reference
    _, outcome = prefilled
    assert outcome.first_token_id == greedy[0]


def test_encode_to_prefill_without_a_handle_the_item_is_found_by_its_mm_hash(demo_model_path, stores, rendered,
                                                                            encoded, reference):
    """vLLM's E/P/D proxy sends prefill no ec_transfer_params: prefill finds the embedding encode stored under the
    item's mm_hash (scoped by model, as encode keys it), encodes nothing, and its first token is HF's.  Under another
    model, or another item's hash (a tenant's uuid under another salt names another item), nothing is found."""
    from services.models.registry import adapter_for
    from services.prefill.engine import PrefillEngine
    from services.prefill.serving import EC_BY_HASH, PrefillItem, PrefillService
    from services.protocol.errors import NotFound
    from services.protocol.serialization import decode_item

    _, greedy = reference
    prompt, [item] = rendered
    lm = adapter_for(demo_model_path).load_language(demo_model_path)

    def first_token(model_id: str, mm_hash: str) -> int:
        engine = PrefillEngine(lm, prefix_cache_mb=0)
        service = PrefillService(engine, lm, stores["ec"], stores["kv"], "p0", model_id=model_id)
        items = [PrefillItem(item.modality, mm_hash, item.offset, item.length, decode_item(item.mm_metadata))]
        try:
            return asyncio.run(service.prefill("flow-2", prompt.token_ids, items, {}, {"temperature": 0.0},
                                               None)).first_token_id
        finally:
            engine.close()

    found = EC_BY_HASH.labels("found")._value.get()
    assert first_token("m", item.mm_hash) == greedy[0]
    assert EC_BY_HASH.labels("found")._value.get() == found + 1
    for model_id, mm_hash in (("another-model", item.mm_hash), ("m", "f" * 64)):
        with pytest.raises(NotFound) as info:
            first_token(model_id, mm_hash)
        assert info.value.code == "ec_entry_missing" and "encode it first" in info.value.message


def test_prefill_to_decode_the_tokens_from_the_kv_entry_are_hfs(demo_model_path, stores, reference, prefilled):
    from services.decode.engine import DecodeEngine
    from services.decode.serving import DecodeService
    from services.models.processing import load_tokenizer

    _, greedy = reference
    lm, outcome = prefilled

    async def main() -> list[int]:
        with DecodeEngine(lm, load_tokenizer(demo_model_path), num_slots=2, max_model_len=1024) as engine:
            service = DecodeService(engine, stores["kv"])
            events = [e async for e in service.decode("flow-1", outcome.kv_transfer_params,
                                                      {"temperature": 0.0, "max_tokens": MAX_TOKENS})]
        return [t for e in events for t in e.token_ids]

    assert asyncio.run(main()) == greedy
