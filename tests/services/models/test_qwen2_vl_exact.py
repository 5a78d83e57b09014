"""Encode -> prefill -> decode through the adapter parts gives exactly the tokens of HF `generate`."""

from __future__ import annotations

import pytest
import torch

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
def reference_model(model_path):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(model_path)).eval()


@pytest.mark.parametrize("name", sorted(CHATS))
def test_split_pipeline_matches_generate(name, processor, vision, lm, reference_model):
    inputs = processor_inputs(processor, CHATS[name]())
    expected = generate_reference(reference_model, inputs, NEW_TOKENS)

    result = prefill_chat(vision, PrefillEngine(lm), inputs)

    assert greedy_continue(lm, result, NEW_TOKENS) == expected
    assert len(expected) == NEW_TOKENS  # no early EOS: the whole continuation was compared
    if name == "text":
        assert result.rope_delta == 0
    else:
        assert result.rope_delta < 0  # images compress positions: a wrong delta would be caught


def test_vision_part_holds_no_language_weights(vision):
    names = [name for name, _ in vision._base.named_parameters()]
    assert names and all(name.startswith("visual.") for name in names)


def test_language_part_holds_no_vision_weights(lm):
    names = [name for name, _ in lm.model.named_parameters()] + ["lm_head"]
    assert "visual" not in " ".join(names)
    assert not any("visual" in name for name, _ in lm._base.named_parameters())


def test_parts_equal_the_full_checkpoint(vision, lm, reference_model):
    full = reference_model.state_dict()
    for name, tensor in vision._base.state_dict().items():
        assert torch.equal(tensor, full[f"model.{name}"]), name
    for name, tensor in lm._base.state_dict().items():
        name = name.replace(".inner.", ".")   # a prefill engine built on this lm wraps two modules (last_rows.py)
        assert torch.equal(tensor, full[f"model.{name}"]), name
    assert torch.equal(lm.lm_head.weight, full["lm_head.weight"])


def test_language_facts(lm):
    assert lm.eos_token_ids == (151645, 151643)
    assert lm.layout.num_layers == 2 and lm.layout.num_kv_heads == 2 and lm.layout.head_dim == 16
    assert lm.layout.dtype == torch.float32 and lm.vocab_size == 151936 and lm.hidden_size == 64


def test_decode_position_ids_shape(lm):
    position_ids = lm.decode_position_ids(torch.tensor([5, 9]))
    assert position_ids.shape == (3, 2, 1) and position_ids.dtype == torch.long
    assert position_ids[:, 1, 0].tolist() == [9, 9, 9]
