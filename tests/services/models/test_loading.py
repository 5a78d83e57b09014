"""Registry, model resolution and part loading across checkpoint layouts and dtypes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.models.loading import ModelLoadError
from services.models.qwen2_vl import Qwen2VLAdapter
from services.models.registry import adapter_for, resolve_model, supported_architectures


def test_adapter_for_the_demo(model_path):
    adapter = adapter_for(model_path)
    assert isinstance(adapter, Qwen2VLAdapter) and adapter.family == "qwen2_vl"
    assert adapter.metadata_keys == ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "timestamps")


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError) as caught:
        adapter_for(tmp_path)
    assert "GPT2LMHeadModel" in str(caught.value)
    assert all(name in str(caught.value) for name in supported_architectures())


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        adapter_for(tmp_path)


def test_resolve_model(model_path, tmp_path):
    assert resolve_model(None) == resolve_model("demo") == resolve_model("epd-demo-qwen2-vl") == model_path
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelLoadError, match="epd-tests/no-such-model"):
        resolve_model("epd-tests/no-such-model")


def test_unknown_dtype(adapter, model_path):
    with pytest.raises(ValueError, match="bfloat16"):
        adapter.load_vision(model_path, "cpu", "float64")


def test_bfloat16_parts(adapter, model_path, processor):
    from tests.services.models.helpers import CHATS, encode_items, processor_inputs

    vision = adapter.load_vision(model_path, "cpu", "bfloat16")
    lm = adapter.load_language(model_path, "cpu", "bfloat16")
    embeddings = vision.encode(encode_items(processor_inputs(processor, CHATS["one_image"]())))
    assert vision.dtype == lm.layout.dtype == embeddings[0].dtype == torch.bfloat16
    assert lm.embed(torch.tensor([[1, 2]])).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tied_new_layout(model_path, tmp_path_factory):
    """The demo checkpoint rewritten with transformers' current key names and tied embeddings (no lm_head)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("tied")
    tensors = load_file(str(model_path / "model.safetensors"))
    renamed = {_new_name(key): value for key, value in tensors.items() if key != "lm_head.weight"}
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    shutil.copy(model_path / "generation_config.json", folder)
    return folder, tensors


def _new_name(key: str) -> str:
    if key.startswith("visual."):
        return "model." + key
    return "model.language_model." + key.removeprefix("model.")


def test_current_layout_with_tied_embeddings(adapter, tied_new_layout):
    folder, legacy = tied_new_layout
    vision = adapter.load_vision(folder)
    lm = adapter.load_language(folder)
    assert torch.equal(vision._base.visual.patch_embed.proj.weight, legacy["visual.patch_embed.proj.weight"])
    assert torch.equal(lm.model.norm.weight, legacy["model.norm.weight"])
    assert torch.equal(lm.lm_head.weight, legacy["model.embed_tokens.weight"])
