"""The vision tower's input path, made faster without changing its numbers: the patch embedding as one
matrix product (a Conv3d whose kernel equals its stride), and uint8 normalisation in one buffer."""

from __future__ import annotations

import torch
from torch import nn

from services.models.input_norm import NormParams, normalize_pixels
from services.models.patch_linear import PatchConv3d, swap_patch_convs


def test_the_loaded_towers_patch_embedding_is_swapped(vision):
    conv = vision.tower.visual.patch_embed.proj
    assert type(conv) is PatchConv3d and conv.weight.shape[1:] == (3, 2, 14, 14)


def test_patch_product_equals_the_convolution_and_other_shapes_still_convolve():
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 64, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=True)
    patches = torch.randn(500, 3, 2, 14, 14)
    video = torch.randn(1, 3, 4, 28, 28)  # not patch-shaped: the convolution's own path
    expected, expected_video = conv(patches), conv(video)
    assert swap_patch_convs(nn.Sequential(conv)) == 1 and type(conv) is PatchConv3d
    got = conv(patches)
    assert got.shape == expected.shape == (500, 64, 1, 1, 1)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert torch.equal(conv(video), expected_video)


def test_the_same_patches_give_the_same_floats_in_any_batch():
    """Batched with other images or alone, an image's patches embed to the same bits (as the convolution's
    did): the encode engine's results must not depend on what else was in the forward."""
    torch.manual_seed(1)
    conv = nn.Conv3d(3, 32, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False)
    swap_patch_convs(conv)
    patches = torch.randn(900, 3, 2, 14, 14)
    together = conv(patches)
    for start, stop in ((0, 256), (256, 512), (5, 300), (100, 101), (3, 900)):
        assert torch.equal(conv(patches[start:stop]), together[start:stop]), (start, stop)


def test_only_kernel_equal_stride_convolutions_are_swapped():
    strided = nn.Conv3d(3, 8, kernel_size=3, stride=1)
    padded = nn.Conv3d(3, 8, kernel_size=2, stride=2, padding=1)
    assert swap_patch_convs(nn.Sequential(strided, padded)) == 0
    assert type(strided) is nn.Conv3d and type(padded) is nn.Conv3d


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
