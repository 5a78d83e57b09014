"""uint8 pixels normalised at the encoder in one buffer, with vLLM's numbers."""

from __future__ import annotations

import torch

from services.models.input_norm import NormParams, normalize_pixels


def test_uint8_normalisation_is_vllms_formula_bit_for_bit():
    """vLLM's FusedMMInputNorm: x * (rescale / std) + (-mean / std) per channel, in float32, two roundings."""
    params = NormParams((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711), 1 / 255)
    pixels = torch.randint(0, 256, (300, 1176), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    std, mean = torch.tensor(params.image_std), torch.tensor(params.image_mean)
    reference = (pixels.view(300, 3, 392) * (params.rescale_factor / std).view(1, 3, 1)
                 + (-mean / std).view(1, 3, 1)).view(300, 1176)
    before = pixels.clone()
    got = normalize_pixels(pixels, params)
    assert got.dtype == torch.float32 and torch.equal(got, reference)
    assert torch.equal(pixels, before)  # the caller's uint8 view (an EC/mm store's memory) is not written
