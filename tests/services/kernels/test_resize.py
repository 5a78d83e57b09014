"""Render's uint8 resize pass (services/kernels/resize.c), every variant this CPU runs, is torch's antialiased
bicubic resize bit for bit, at photo sizes that shrink, grow and keep the aspect ratio, odd sizes included."""

from __future__ import annotations

import numpy as np
import pytest

from services.render import qwen_pixels
from tests.support.kernel_variants import only_variant, runnable

SIZES = [((480, 640), (476, 644)), ((768, 1024), (756, 1036)), ((1600, 1200), (224, 168)), ((45, 61), (56, 84)),
         ((7, 400), (13, 391))]


@pytest.fixture
def fresh_pass(monkeypatch):
    monkeypatch.setattr(qwen_pixels, "_KERNEL", [])   # the module keeps the pass it loaded first
    yield


@pytest.mark.parametrize("variant", runnable("resize"))
def test_every_variant_is_torchs_resize(monkeypatch, fresh_pass, variant):
    import torch

    with only_variant(monkeypatch, "resize", variant):
        assert qwen_pixels.resample_kernel() is not None
        for source, target in SIZES:
            image = np.random.default_rng(sum(source)).integers(0, 256, (3, *source), dtype=np.uint8)
            expected = torch.nn.functional.interpolate(torch.from_numpy(image)[None], size=list(target),
                                                       mode="bicubic", align_corners=False, antialias=True)[0]
            assert np.array_equal(qwen_pixels.resize_uint8(image, *target, use_c=True), expected.numpy()), source


def test_with_the_kernel_off_render_runs_numpy_and_says_so(monkeypatch, fresh_pass):
    from services.kernels import loader

    monkeypatch.setenv(loader.ENV_OFF, "resize")
    loader.reset()
    try:
        assert qwen_pixels.resample_kernel() is None
    finally:
        monkeypatch.delenv(loader.ENV_OFF)
        loader.reset()
