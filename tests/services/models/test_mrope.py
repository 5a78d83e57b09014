"""Prefill's M-RoPE positions (services/models/mrope.py) against each Qwen-VL family's own `get_rope_index` and
against vLLM's `get_mrope_input_positions`, position for position and in rope_delta.

Images (0-3 per prompt, many grid shapes) and videos whose time span stays inside their spatial span: equal to
transformers'.  Videos of any length: equal to vLLM's rule (transcribed below from vllm 0.32's qwen2_5_vl.py,
Qwen2-VL's being the same without t_factor).  Where a video's temporal positions run past its spatial ones,
transformers 5.x starts the text after it inside the video's time span and vLLM after it: a test shows the two
parting, so the choice (vLLM's) is visible."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.models.base import MultiModalInput
from services.models.loading import InvalidMultiModalInput
from services.models.mrope import Segment, mrope_positions
from services.models.qwen2_vl import _grid
from services.models.registry import adapter_for
from services.models.tiny import VIDEO_PAD, VISION_END, VISION_START, tiny_model_path

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    path = tiny_model_path(request.param)
    return adapter_for(path).load_language(path)


def _image(at: int, rows: int, cols: int, merge: int) -> MultiModalInput:
    grid = torch.tensor([[1, rows * merge, cols * merge]])
    return MultiModalInput("image", at, rows * cols, {"image_grid_thw": grid}, torch.zeros(rows * cols, 1))


def layouts(merge: int, count: int, seed: int):
    """(prompt length, items): images of random merged grids with text of 1-9 tokens around."""
    rng = random.Random(seed)
    for _ in range(count):
        items, at = [], rng.randint(0, 9)
        for _ in range(rng.randint(1, 3)):
            rows, cols = rng.randint(1, 9), rng.randint(1, 9)
            items.append(_image(at, rows, cols, merge))
            at += rows * cols + rng.randint(1, 9)
        yield at + rng.randint(0, 9), items


def hf_positions(lm, ids: torch.Tensor, items: list[MultiModalInput]) -> tuple[torch.Tensor, int]:
    """The model's own `get_rope_index` for the same prompt (what `mrope_positions` must equal)."""
    token_ids = ids[0].tolist()
    token_types = torch.zeros_like(ids)
    grids: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    seconds = []
    for item in sorted(items, key=lambda i: i.offset):
        for seg in lm.segments(token_ids, item):
            token_types[0, seg.offset:seg.offset + seg.tokens] = 1 if item.modality == "image" else 2
        grids[item.modality].append(_grid(item.metadata))
        if "second_per_grid_ts" in item.metadata:
            seconds.append(item.metadata["second_per_grid_ts"].reshape(-1)[0].float())
    kwargs = {f"{m}_grid_thw": torch.stack(g).to(lm.device) for m, g in grids.items() if g}
    if seconds:
        kwargs["second_per_grid_ts"] = torch.stack(seconds)
    position_ids, deltas = lm._base.get_rope_index(ids, token_types, **kwargs)
    return position_ids, int(deltas.reshape(-1)[0])


def test_image_positions_equal_get_rope_index(lm):
    merge = lm._base.config.vision_config.spatial_merge_size
    checked = 0
    for length, items in layouts(merge, 60, seed=7):
        ids = [0] * length
        got, got_delta = lm._positions(ids, items)
        want, want_delta = hf_positions(lm, torch.tensor([ids]), items)
        assert got.dtype == want.dtype and torch.equal(got, want), [(i.offset, i.length) for i in items]
        assert got_delta == want_delta
        checked += 1
    assert checked == 60


def _video(lm, at: int, groups: int, rows: int, cols: int, seconds: float | None = None):
    """Token ids of a video placed at `at` (the family's layout) and its item."""
    merge = lm._base.config.vision_config.spatial_merge_size
    grid = {"video_grid_thw": torch.tensor([groups, rows * merge, cols * merge])}
    if seconds is not None:
        grid["second_per_grid_ts"] = torch.tensor(seconds)
    if lm.sparse_modalities:   # Qwen3-VL: per group "<t seconds>" (3 text tokens here), start, pads, end
        ids = []
        for _ in range(groups):
            ids += [27, 15, 29, VISION_START] + [VIDEO_PAD] * (rows * cols) + [VISION_END]
    else:
        ids = [VIDEO_PAD] * (groups * rows * cols)
    rows_total = groups * rows * cols
    return ids, MultiModalInput("video", at, len(ids), grid, torch.zeros(rows_total, 1))


@pytest.mark.parametrize(("groups", "rows", "cols", "seconds"), [(2, 4, 6, 1.0), (1, 3, 5, None), (3, 8, 6, 0.5)])
def test_short_video_positions_equal_get_rope_index(lm, groups, rows, cols, seconds):
    """A video and an image after it, where transformers and vLLM agree (the time span inside the spatial one)."""
    ids, video = _video(lm, 2, groups, rows, cols, seconds)
    image = _image(2 + len(ids) + 3, 2, 3, lm._base.config.vision_config.spatial_merge_size)
    prompt = [1, 2] + ids + [3, 4, 5] + [0] * image.length + [6, 7]
    got, got_delta = lm._positions(prompt, [video, image])
    want, want_delta = hf_positions(lm, torch.tensor([prompt]), [video, image])
    assert torch.equal(got, want) and got_delta == want_delta


def vllm_positions(length: int, grids: list[tuple[int, int, int, int, float]]) -> tuple[np.ndarray, int]:
    """vllm 0.32 Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions, transcribed: grids are
    (offset, llm_grid_t, llm_grid_h, llm_grid_w, t_factor)."""
    parts: list[np.ndarray] = []
    st = 0
    for offset, t, h, w, t_factor in grids:
        text_len = offset - st
        st_idx = parts[-1].max() + 1 if parts else 0
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        indices = np.indices((t, h, w))
        if t_factor != 1.0:
            indices[0] = (indices[0] * t_factor).astype(np.int64)
        parts.append(indices.reshape(3, -1) + text_len + st_idx)
        st = offset + t * h * w
    if st < length:
        st_idx = parts[-1].max() + 1 if parts else 0
        parts.append(np.broadcast_to(np.arange(length - st), (3, length - st)) + st_idx)
    positions = np.concatenate(parts, axis=1).reshape(3, -1)
    return positions, int(positions.max() + 1 - length)


@pytest.mark.parametrize(("t", "h", "w", "t_factor"), [(16, 4, 4, 1.0), (9, 3, 2, 4.0), (5, 8, 8, 2.6), (7, 2, 2, 1.3)])
def test_long_video_positions_equal_vllm_and_part_from_transformers_5(t, h, w, t_factor):
    seg = Segment(5, t * h * w, (t, 2 * h, 2 * w), t_factor)
    length = 5 + seg.tokens + 4
    got, delta = mrope_positions(length, [seg], 2)
    want, want_delta = vllm_positions(length, [(5, t, h, w, t_factor)])
    assert np.array_equal(got, want) and delta == want_delta
    after = got[:, 5 + seg.tokens]   # transformers 5.x: start + max(h, w) = 5 + max(h, w), inside the video's span
    assert after.tolist() == [int(got[:, 5:5 + seg.tokens].max()) + 1] * 3 and after[0] > 5 + max(h, w)


def test_a_position_bug_would_show():
    """Negative controls: the same prompt with the text after the image starting one place early, or rows and
    columns swapped, differs from the right answer."""
    right, delta = mrope_positions(12, [Segment(2, 6, (1, 4, 6))], 2)
    assert right[:, :2].tolist() == [[0, 1]] * 3
    assert right[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert right[:, 8:].tolist() == [[5, 6, 7, 8]] * 3 and delta == 9 - 12
    swapped, _ = mrope_positions(12, [Segment(2, 6, (1, 6, 4))], 2)
    assert not np.array_equal(right, swapped)


def test_a_grid_that_does_not_give_the_run_is_refused():
    with pytest.raises(InvalidMultiModalInput, match="does not give 5 tokens"):
        mrope_positions(10, [Segment(1, 5, (1, 4, 4))], 2)


def test_an_image_with_more_than_one_frame_is_refused(lm):
    item = MultiModalInput("image", 1, 4, {"image_grid_thw": torch.tensor([2, 2, 4])}, torch.zeros(4, 1))
    with pytest.raises(InvalidMultiModalInput, match="t != 1"):
        lm._positions([0] * 8, [item])
