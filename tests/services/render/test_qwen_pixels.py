"""Render's ports of torch's uint8 antialiased bicubic resize (the C pass and the numpy fallback) are torch's,
bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from services.render import qwen_pixels as qp
from services.render.qwen_pixels import QwenPixelSettings, patchify, resample_kernel, resize_uint8

SIZES = [((200, 300), (196, 308)), ((128, 128), (140, 140)), ((45, 60), (56, 56)), ((30, 90), (56, 112)),
         ((1000, 37), (1008, 28)), ((7, 400), (13, 391)), ((480, 640), (476, 644)), ((333, 222), (111, 74)),
         ((1600, 1200), (224, 168)), ((3000, 40), (28, 28)), ((768, 1024), (756, 1036))]  # big shrinks: high precision


@pytest.mark.parametrize(("use_c", "halves"), [(True, False), (True, True), (False, False)],
                         ids=["c", "c-halves", "numpy"])
@pytest.mark.parametrize(("source", "target"), SIZES)
def test_resize_equals_torch_interpolate_on_uint8(source, target, use_c, halves):
    """`halves`: each C pass's rows in two halves on two threads (large images): the same bytes."""
    import torch

    image = np.random.default_rng(sum(source)).integers(0, 256, (3, *source), dtype=np.uint8)
    expected = torch.nn.functional.interpolate(torch.from_numpy(image)[None], size=list(target), mode="bicubic",
                                               align_corners=False, antialias=True)[0].numpy()
    assert np.array_equal(resize_uint8(image, *target, use_c=use_c, halves=halves), expected)


def test_the_c_pass_is_built_and_reads_a_decoded_images_memory():
    """gcc builds the kernel on this machine (else render silently runs the ~5x slower numpy passes), and a
    decoded image's [H, W, C] memory, seen as [C, H, W], comes out the same as a contiguous copy's."""
    assert resample_kernel() is not None
    hwc = np.random.default_rng(7).integers(0, 256, (97, 131, 3), dtype=np.uint8)
    view = hwc.transpose(2, 0, 1)
    assert np.array_equal(resize_uint8(view, 56, 140), resize_uint8(np.ascontiguousarray(view), 56, 140, use_c=False))


def test_same_size_is_not_resampled():
    image = np.arange(3 * 28 * 56, dtype=np.uint8).reshape(3, 28, 56)
    assert resize_uint8(image, 28, 56) is image


def test_patchify_is_the_processors_layout():
    import torch

    settings = QwenPixelSettings(3136, 12845056, 14, 2, 2)
    image = np.random.default_rng(1).integers(0, 256, (3, 56, 84), dtype=np.uint8)
    pixels, grid = patchify(image, settings)
    # transformers' Qwen2VLImageProcessor.patchify, written out with torch
    x = torch.from_numpy(image)[None].reshape(1, 3, 2, 2, 14, 3, 2, 14).permute(0, 2, 5, 3, 6, 1, 4, 7)
    expected = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, 2, -1, -1).reshape(1, 24, 1176)[0].numpy()
    assert np.array_equal(pixels, expected) and grid.tolist() == [1, 4, 6]


@pytest.mark.parametrize("halves", [False, True])
def test_patchify_is_the_processors_layout_in_halves_too(halves):
    settings = QwenPixelSettings(3136, 12845056, 14, 2, 2)
    image = np.random.default_rng(2).integers(0, 256, (3, 140, 84), dtype=np.uint8)  # 5 merged rows: odd halves
    pixels, grid = patchify(image, settings, halves)
    one, _ = patchify(image, settings)
    assert np.array_equal(pixels, one) and pixels.flags.c_contiguous and grid.tolist() == [1, 10, 6]


def test_a_large_image_runs_in_halves_with_the_same_arrays(monkeypatch):
    """From SPLIT_PIXELS output pixels the resize and the patch copy run on two threads; the arrays are the
    one-thread arrays byte for byte (a 1024x768 image resizes to 756x1036, past the threshold)."""
    from PIL import Image

    settings = QwenPixelSettings(3136, 12845056, 14, 2, 2)
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (768, 1024, 3), dtype=np.uint8))
    halves = []
    in_halves = qp._in_halves
    monkeypatch.setattr(qp, "_in_halves", lambda fn, count, split: (halves.append(split), in_halves(fn, count, split)))
    split = qp.qwen_pixels(image, settings)
    monkeypatch.setattr(qp, "SPLIT_PIXELS", 1 << 40)
    whole = qp.qwen_pixels(image, settings)
    assert halves == [True, True, True, False, False, False]   # two resize passes and the copy, then none
    assert all(np.array_equal(split[key], whole[key]) for key in whole) and split.keys() == whole.keys()
