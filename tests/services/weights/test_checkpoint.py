"""A weight update's checkpoint is checked before anything loads: same architecture, same tensors and shapes."""

from __future__ import annotations

import json

import pytest

from services.protocol.errors import InvalidRequest
from services.weights.checkpoint import check_checkpoint, tensor_shapes
from tests.support.checkpoints import other_shape, other_weights


def test_the_same_model_with_other_weights_passes(demo_model_path, tmp_path):
    folder = other_weights(demo_model_path, tmp_path / "step-1")
    assert check_checkpoint(str(folder), demo_model_path) == folder
    assert tensor_shapes(folder) == tensor_shapes(demo_model_path)


@pytest.mark.parametrize("case", ["missing", "not_a_checkpoint", "other_shape", "other_tensor", "no_safetensors"])
def test_anything_else_is_refused_naming_the_difference(demo_model_path, tmp_path, case):
    if case == "missing":
        path, expected = str(tmp_path / "nope"), "is not a folder on this instance"
    elif case == "not_a_checkpoint":
        (tmp_path / "empty").mkdir()
        path, expected = str(tmp_path / "empty"), "no config.json"
    elif case == "other_shape":
        path, expected = str(other_shape(demo_model_path, tmp_path / "wide")), "config text_config.hidden_size is"
    elif case == "no_safetensors":
        folder = tmp_path / "bare"
        folder.mkdir()
        (folder / "config.json").write_text((demo_model_path / "config.json").read_text())
        path, expected = str(folder), "no *.safetensors file"
    else:
        from safetensors.torch import load_file, save_file

        folder = other_weights(demo_model_path, tmp_path / "renamed")
        tensors = load_file(str(folder / "model.safetensors"))
        name = sorted(tensors)[0]
        tensors[name + "_x"] = tensors.pop(name)
        save_file(tensors, str(folder / "model.safetensors"))
        path, expected = str(folder), "tensors differ from the served model's (1 missing"
    with pytest.raises(InvalidRequest, match="") as caught:
        check_checkpoint(path, demo_model_path)
    assert expected in caught.value.message and caught.value.code == "invalid_checkpoint"
    assert json.loads((demo_model_path / "config.json").read_text())   # the served folder is untouched
