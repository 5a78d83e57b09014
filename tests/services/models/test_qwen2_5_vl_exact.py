"""Qwen2.5-VL through the adapter parts gives exactly the tokens of HF `generate`.

A tiny random Qwen2.5-VL (window attention in the tower, `out_hidden_size` =
LM width) is built here; prompts come from the demo's Qwen2-VL processor,
which Qwen2.5-VL shares.
"""

from __future__ import annotations

import pytest
import torch

from services.models.qwen2_vl import Qwen2_5_VLAdapter
from services.models.registry import adapter_for
from services.prefill.engine import PrefillEngine
from tests.services.models.helpers import (
    CHATS,
    generate_reference,
    greedy_continue,
    prefill_chat,
    processor_inputs,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def qwen25_path(tmp_path_factory):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from services.models.demo import TINY_TEXT, _mrope_section

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(16)}
    config = Qwen2_5_VLConfig(
        text_config={**TINY_TEXT, "vocab_size": 151936, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
                     "rope_parameters": rope, "eos_token_id": 151645},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1],
                       "initializer_range": 0.1},
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, eos_token_id=151645, tie_word_embeddings=False)
    torch.manual_seed(25)
    folder = tmp_path_factory.mktemp("qwen25")
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen25(qwen25_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    adapter = adapter_for(qwen25_path)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(qwen25_path)).eval()
    return adapter, adapter.load_vision(qwen25_path), adapter.load_language(qwen25_path), reference


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_split_pipeline_matches_generate(name, processor, qwen25):
    adapter, vision, lm, reference = qwen25
    inputs = processor_inputs(processor, CHATS[name]())
    expected = generate_reference(reference, inputs, NEW_TOKENS)

    result = prefill_chat(vision, PrefillEngine(lm), inputs)

    assert isinstance(adapter, Qwen2_5_VLAdapter)
    assert greedy_continue(lm, result, NEW_TOKENS) == expected and len(expected) == NEW_TOKENS


def test_parts_are_disjoint(qwen25):
    _, vision, lm, _ = qwen25
    assert all(name.startswith("visual.") for name, _ in vision._base.named_parameters())
    assert not any("visual" in name for name, _ in lm._base.named_parameters())
    assert vision.hidden_size == lm.hidden_size == 64 and lm.eos_token_ids == (151645,)
