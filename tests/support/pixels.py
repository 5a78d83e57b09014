"""Compare render's pixel_values with an HF processor's, whichever form render sent.

Qwen-VL items carry vLLM's raw uint8 patches (torchvision-resized, normalised at the encoder);
the HF PIL processor returns normalised float32 of its own resize.  Where no resize happens the
two see the same pixels: after vLLM's normalisation they agree to float rounding (2e-6).  Where a
resize happens they differ by design (PIL vs torchvision): the uint8 patches must then be exactly
torchvision's (`qwen_pixels`); the interop suite checks those against a real vLLM.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

ATOL = 2e-6


def assert_pixels_match(pixels: np.ndarray, expected: np.ndarray, image: Image.Image, hf_image_processor) -> None:
    import torch

    from services.models.input_norm import NormParams, normalize_pixels
    from services.render.qwen_pixels import QwenPixelSettings, qwen_pixels, resized_size

    if pixels.dtype != np.uint8:
        assert np.array_equal(pixels, expected)
        return
    settings = QwenPixelSettings.from_processor(hf_image_processor)
    assert settings is not None
    assert np.array_equal(pixels, qwen_pixels(image, settings)["pixel_values"])
    if resized_size(image.height, image.width, settings) == (image.height, image.width):
        params = NormParams.from_config(hf_image_processor.to_dict())
        normalised = normalize_pixels(torch.from_numpy(pixels.copy()), params).numpy()
        assert np.allclose(normalised, expected, atol=ATOL, rtol=0)
