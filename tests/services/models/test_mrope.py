"""Prefill's M-RoPE positions (services/models/qwen2_vl.py `mrope_positions`) equal each Qwen-VL family's own
`get_rope_index`, position for position and in rope_delta, on prompts of 0-3 images of many grid shapes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.models.base import MultiModalInput
from services.models.loading import InvalidMultiModalInput
from services.models.qwen2_vl import mrope_positions
from services.models.registry import adapter_for
from services.models.tiny import tiny_model_path

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    path = tiny_model_path(request.param)
    return adapter_for(path).load_language(path)


def layouts(merge: int, count: int, seed: int):
    """(prompt length, items): images of random merged grids (t of 1 or 2) with text of 1-9 tokens around."""
    rng = random.Random(seed)
    for _ in range(count):
        items, at = [], rng.randint(0, 9)
        for _ in range(rng.randint(1, 3)):
            t, rows, cols = rng.choice((1, 1, 2)), rng.randint(1, 9), rng.randint(1, 9)
            tokens = t * rows * cols
            grid = torch.tensor([[t, rows * merge, cols * merge]])
            items.append(MultiModalInput("image", at, tokens, {"image_grid_thw": grid}, torch.zeros(tokens, 1)))
            at += tokens + rng.randint(1, 9)
        yield at + rng.randint(0, 9), items


def test_positions_equal_get_rope_index(lm):
    merge = lm._base.config.vision_config.spatial_merge_size
    checked = 0
    for length, items in layouts(merge, 60, seed=7):
        ids = torch.zeros(1, length, dtype=torch.long)
        got, got_delta = lm._positions(ids, items)
        want, want_delta = lm.hf_positions(ids, items)
        assert got.dtype == want.dtype and torch.equal(got, want), [(i.offset, i.length) for i in items]
        assert got_delta == want_delta
        checked += 1
    assert checked == 60


def test_a_position_bug_would_show():
    """Negative controls: the same prompt with the text after the image starting one place early, or rows and
    columns swapped, differs from the right answer."""
    right, delta = mrope_positions(12, [(2, 6, [1, 4, 6])], 2)
    assert right[:, :2].tolist() == [[0, 1]] * 3
    assert right[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert right[:, 8:].tolist() == [[5, 6, 7, 8]] * 3 and delta == 9 - 12
    swapped, _ = mrope_positions(12, [(2, 6, [1, 6, 4])], 2)
    assert not np.array_equal(right, swapped)


def test_a_grid_that_does_not_give_the_run_is_refused():
    with pytest.raises(InvalidMultiModalInput, match="does not give 5 tokens"):
        mrope_positions(10, [(1, 5, [1, 4, 4])], 2)
