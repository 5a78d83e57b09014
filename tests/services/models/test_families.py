"""Adapters of the families beyond Qwen2-VL: registry choice, EC entries, deepstack, and the E -> P -> D
split giving exactly the tokens of HF `generate` (tiny checkpoints from services.models.tiny)."""

from __future__ import annotations

import pytest
import torch

from services.models.base import MultiModalInput
from services.models.causal_lm import CausalLMAdapter
from services.models.llava import LlavaAdapter
from services.models.qwen2_vl import Qwen2_5_VLAdapter
from services.models.qwen3_vl import Qwen3VLAdapter
from services.models.registry import adapter_for
from services.prefill.engine import PrefillEngine
from tests.services.models.helpers import chat, generate_reference, greedy_continue, picture, processor_inputs

NEW_TOKENS = 8
ADAPTERS = {"qwen2_5_vl": Qwen2_5_VLAdapter, "qwen3_vl": Qwen3VLAdapter, "llava": LlavaAdapter,
            "qwen2": CausalLMAdapter, "llama": CausalLMAdapter}
VLMS = ("qwen3_vl", "llava")  # Qwen2.5-VL: test_qwen2_5_vl_exact.py


def tiny(family: str):
    from services.models.tiny import tiny_model_path

    return tiny_model_path(family)


class Parts:
    """Adapter, processor, reference model and the two parts of one tiny checkpoint."""

    def __init__(self, family: str) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from services.models.processing import load_processor

        path = tiny(family)
        self.adapter = adapter_for(path)
        self.spec = self.adapter.render_spec(path)
        self.processor = load_processor(path)
        auto = AutoModelForImageTextToText if self.adapter.has_vision() else AutoModelForCausalLM
        self.reference = auto.from_pretrained(str(path)).eval()
        self.vision = self.adapter.load_vision(path) if self.adapter.has_vision() else None
        self.lm = self.adapter.load_language(path)

    def inputs(self, *images) -> dict:
        return processor_inputs(self.processor, chat(*images))

    def mm_inputs(self, inputs: dict) -> list[MultiModalInput]:
        """Encode as the encode role does (one EC entry per image) and place entries at their runs."""
        if "pixel_values" not in inputs:
            return []
        if "image_grid_thw" in inputs:
            grids = inputs["image_grid_thw"]
            pixels = torch.split(inputs["pixel_values"], grids.prod(-1).tolist())
            items = [{"pixel_values": p, "image_grid_thw": g} for p, g in zip(pixels, grids, strict=True)]
        else:
            items = [{"pixel_values": p[None]} for p in inputs["pixel_values"]]
        runs = image_runs(inputs["input_ids"][0].tolist(), self.spec.image_token_id)
        out = []
        for (offset, length), item, entry in zip(runs, items, self.vision.encode_entries(items), strict=True):
            extras = dict(entry)
            metadata = {k: v for k, v in item.items() if k in self.adapter.metadata_keys}
            out.append(MultiModalInput("image", offset, length, metadata, extras.pop("embedding"), extras=extras))
        return out


def image_runs(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for index, token in enumerate(token_ids):
        if token == image_token_id:
            if runs and sum(runs[-1]) == index:
                runs[-1][1] += 1
            else:
                runs.append([index, 1])
    return [(offset, length) for offset, length in runs]


@pytest.fixture(scope="module", params=VLMS)
def vlm(request):
    return request.param, Parts(request.param)


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_registry_picks_the_family_adapter(family):
    adapter = adapter_for(tiny(family))
    assert type(adapter) is ADAPTERS[family]
    assert adapter.has_vision() == (family not in ("qwen2", "llama"))
    assert adapter.render_spec(tiny(family)).accepts_images == adapter.has_vision()


@pytest.mark.parametrize("images", [0, 1, 2])
def test_split_pipeline_matches_generate(vlm, images):
    _, parts = vlm
    pictures = [picture(448, 448, seed=1), picture(224, 336, seed=2)][:images]
    inputs = parts.inputs(*pictures)
    expected = generate_reference(parts.reference, inputs, NEW_TOKENS)
    token_ids = inputs["input_ids"][0].tolist()
    result = PrefillEngine(parts.lm).prefill(token_ids, parts.mm_inputs(inputs))
    assert greedy_continue(parts.lm, result, NEW_TOKENS) == expected and len(expected) == NEW_TOKENS


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_text_model_matches_generate(family):
    parts = Parts(family)
    inputs = dict(parts.processor.apply_chat_template(chat(text="Write a haiku about the sea."), tokenize=True,
                                                      add_generation_prompt=True, return_dict=True,
                                                      return_tensors="pt"))
    expected = generate_reference(parts.reference, inputs, NEW_TOKENS)
    result = PrefillEngine(parts.lm).prefill(inputs["input_ids"][0].tolist())
    assert greedy_continue(parts.lm, result, NEW_TOKENS) == expected and result.rope_delta == 0
    assert parts.lm.decode_position_ids(torch.tensor([5, 7])).shape == (2, 1)


def test_token_count_agrees_across_processor_spec_and_tower(vlm):
    family, parts = vlm
    inputs = parts.inputs(picture(300, 200, seed=4))
    [item] = parts.mm_inputs(inputs)
    assert item.length == parts.vision.num_tokens(item.metadata) == item.embedding.shape[0]
    if family == "llava":  # a fixed count, no metadata: nothing but the embedding travels
        assert item.length == parts.spec.tokens_per_image and parts.adapter.metadata_keys == ()
        assert item.extras == {}


@pytest.fixture(scope="module")
def qwen3():
    parts = Parts("qwen3_vl")
    inputs = parts.inputs(picture(448, 448, seed=1), picture(224, 336, seed=2))
    return parts, inputs, parts.mm_inputs(inputs)


def test_qwen3_vl_entry_carries_deepstack(qwen3):
    parts, _, items = qwen3
    for item in items:
        assert item.extras["deepstack"].shape == (2, item.length, parts.lm.hidden_size)


def test_qwen3_vl_deepstack_changes_the_output(qwen3):
    parts, inputs, items = qwen3
    token_ids = inputs["input_ids"][0].tolist()
    with_deepstack = PrefillEngine(parts.lm).prefill(token_ids, items)
    zeroed = [MultiModalInput(i.modality, i.offset, i.length, i.metadata, i.embedding,
                              extras={"deepstack": torch.zeros_like(i.extras["deepstack"])}) for i in items]
    without = PrefillEngine(parts.lm).prefill(token_ids, zeroed)
    assert not torch.allclose(with_deepstack.first_logits, without.first_logits, atol=1e-3)


def test_qwen3_vl_missing_deepstack_is_a_bad_request(qwen3):
    parts, inputs, items = qwen3
    bare = [MultiModalInput(i.modality, i.offset, i.length, i.metadata, i.embedding) for i in items]
    with pytest.raises(ValueError, match="deepstack"):
        parts.lm.prefill_inputs(inputs["input_ids"][0].tolist(), bare)


def test_qwen3_vl_prefix_cache_hit_inside_an_image_is_exact(qwen3):
    parts, inputs, items = qwen3
    token_ids = inputs["input_ids"][0].tolist()
    first, second = items
    # Only the first image is hashed: blocks stop being cacheable at the second, so a warm prefill
    # starts between the images and must pass the deepstack features of the second image only.
    hashed = [MultiModalInput(first.modality, first.offset, first.length, first.metadata, first.embedding,
                              mm_hash="first", extras=first.extras), second]
    engine = PrefillEngine(parts.lm, prefix_cache_mb=1, block_size=16)
    cold = engine.prefill(token_ids, hashed)
    warm = engine.prefill(token_ids, hashed)
    assert first.offset < warm.num_cached_tokens <= second.offset
    assert greedy_continue(parts.lm, warm, NEW_TOKENS) == greedy_continue(parts.lm, cold, NEW_TOKENS)
    torch.testing.assert_close(warm.first_logits, cold.first_logits, rtol=1e-4, atol=1e-4)


def test_qwen3_vl_batched_and_chunked_adds_deepstack_at_the_right_rows(qwen3):
    parts, inputs, items = qwen3
    token_ids = inputs["input_ids"][0].tolist()
    text_ids = parts.inputs()["input_ids"][0].tolist()
    alone = PrefillEngine(parts.lm, prefix_cache_mb=0).prefill(token_ids, items)
    budget = items[0].offset + items[0].length // 2  # the first forward ends inside the first image
    engine = PrefillEngine(parts.lm, prefix_cache_mb=0, max_num_batched_tokens=budget)
    with engine._cond:  # queued together: the text prompt and the image prompt share forwards
        futures = [engine.submit(text_ids), engine.submit(token_ids, items)]
    text, image = (future.result(60) for future in futures)
    text.release()
    with image:
        assert max(chunks for chunks, _ in engine.recent_batches) == 2
        relative = float((image.first_logits - alone.first_logits).abs().max() / alone.first_logits.abs().max())
        assert relative <= 1e-4
        torch.testing.assert_close(image.kv(), alone.kv, rtol=0, atol=1e-5)


def test_tiny_names_resolve_to_their_checkpoints():
    from services.models.registry import resolve_model

    assert resolve_model("tiny-qwen3-vl") == resolve_model("tiny-qwen3_vl") == tiny("qwen3_vl")
