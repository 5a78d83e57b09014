"""Fused MLPs and the GEMM patch embedding (services/models/fused_mlp.py): the same outputs as the modules they
replace (float32 rounding), the same greedy tokens, one copy of each weight — and a wrongly wired fusion is
caught by the same comparison."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from services.models.fused_mlp import (
    FusedGatedMLP,
    GemmPatchEmbed,
    InPlaceActMLP,
    fuse_mlps,
    gemm_patch_embeds,
    packed_gated,
)
from services.models.prepack import PackedLinear, prepack_language, prepack_vision
from tests.services.models.test_prepack import _greedy, _load


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@torch.inference_mode()
def test_fused_gated_mlp_matches_the_model_mlp_and_a_miswired_one_does_not(demo_model_path):
    mlp = _load(demo_model_path).model.layers[0].mlp
    x = torch.randn(37, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(0))
    want = mlp(x)
    fused = packed_gated(mlp)
    assert isinstance(fused.gate_proj, PackedLinear) and isinstance(fused.down_proj, PackedLinear)
    assert _rel(fused(x), want) <= 1e-5
    assert fused(x[None]).shape == (1, 37, mlp.down_proj.out_features)    # a [1, T, hidden] forward too
    # negative control: gate and up exchanged (SiLU on the wrong GEMM) is far off
    swapped = FusedGatedMLP(fused.up_proj, fused.gate_proj, fused.down_proj)
    assert _rel(swapped(x), want) > 1e-2


def test_prefill_stack_with_fused_mlps_gives_the_same_tokens_and_one_copy_of_each_weight(demo_model_path):
    plain, fused = _load(demo_model_path), _load(demo_model_path)
    gate = weakref.ref(fused.model.layers[0].mlp.gate_proj.weight)
    report = prepack_language(fused, "prepacked", fuse=True)
    gc.collect()
    assert gate() is None
    layers = len(fused.model.layers)
    assert report.num_fused == layers and report.num_swapped == 7 * layers + 1
    assert all(isinstance(layer.mlp, FusedGatedMLP) for layer in fused.model.layers)
    assert f"{layers} fused" in report.line()
    ids = list(range(1000, 1040))
    want, want_logits = _greedy(plain, ids, 12)
    got, got_logits = _greedy(fused, ids, 12)
    assert got == want
    assert _rel(got_logits, want_logits) <= 1e-4


def test_fusion_follows_the_mode(demo_model_path):
    lm = _load(demo_model_path)
    assert fuse_mlps(lm.model, "default").count == 0 and fuse_mlps(lm.model, "panel").count == 0
    assert not isinstance(lm.model.layers[0].mlp, FusedGatedMLP)
    report = fuse_mlps(lm.model, "auto", rows=(8, 64))
    assert report.speedup is not None and report.speedup > 0 and report.max_rel_diff is not None
    fused = isinstance(lm.model.layers[0].mlp, FusedGatedMLP)
    assert fused == (report.gated == len(lm.model.layers))
    assert fused == (report.speedup >= 1.05 and report.max_rel_diff <= 1e-4)
    assert fused or "not used" in report.reason


@pytest.mark.parametrize("act", ["quick_gelu", "silu", "gelu"])
@torch.inference_mode()
def test_in_place_activation_mlp_matches(act):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp

    torch.manual_seed(0)
    mlp = VisionMlp(dim=64, hidden_dim=256, hidden_act=act)
    x = torch.randn(50, 64)
    want = mlp(x)
    holder = nn.Sequential(mlp)
    report = fuse_mlps(holder, "auto")
    assert report.in_place == 1 and isinstance(holder[0], InPlaceActMLP) and holder[0].act_name == act
    assert _rel(holder[0](x), want) <= 1e-6


@torch.inference_mode()
def test_gemm_patch_embed_matches_the_convolution():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

    torch.manual_seed(0)
    embed = PatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=64)
    pixels = torch.randn(20, 3 * 2 * 14 * 14)
    want = embed(pixels)
    holder = nn.Sequential(embed)
    assert gemm_patch_embeds(holder) == 1 and isinstance(holder[0], GemmPatchEmbed)
    assert holder[0].proj.weight.dtype == torch.float32
    assert _rel(holder[0](pixels), want) <= 1e-5
    # negative control: a patch read in the wrong order (H and W exchanged) is caught
    transposed = pixels.view(20, 3, 2, 14, 14).transpose(-1, -2).reshape(20, -1)
    assert _rel(holder[0](transposed), want) > 1e-2


@torch.inference_mode()
def test_gemm_patch_embed_gives_the_same_bits_in_any_batch():
    """An image's patches embed to the same floats alone or batched with others' (as the convolution's did):
    the encode engine's result must not depend on what else shared the forward."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

    torch.manual_seed(1)
    holder = nn.Sequential(PatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=32))
    gemm_patch_embeds(holder)
    pixels = torch.randn(900, 3 * 2 * 14 * 14)
    together = holder[0](pixels)
    for start, stop in ((0, 256), (256, 512), (5, 300), (100, 101), (3, 900)):
        assert torch.equal(holder[0](pixels[start:stop]), together[start:stop]), (start, stop)


@pytest.mark.parametrize("mode", ["auto", "prepacked"])
def test_vision_tower_with_fused_parts_gives_the_same_embeddings(demo_model_path, mode):
    import numpy as np
    from PIL import Image

    from services.models.processing import load_processor
    from services.models.registry import adapter_for

    adapter = adapter_for(demo_model_path)
    image = Image.fromarray((np.random.RandomState(3).rand(56, 84, 3) * 255).astype("uint8"))
    item = dict(load_processor(demo_model_path).image_processor(images=[image], return_tensors="pt"))
    plain, fused = adapter.load_vision(demo_model_path), adapter.load_vision(demo_model_path)
    report = prepack_vision(fused, mode)
    blocks = fused.tower.visual.blocks
    assert report.num_fused == len(blocks) + 1                # every block's MLP and the patch embedding
    assert all(isinstance(block.mlp, InPlaceActMLP) for block in blocks)
    assert isinstance(fused.tower.visual.patch_embed, GemmPatchEmbed)
    want, got = plain.encode([item])[0], fused.encode([item])[0]
    assert _rel(got, want) <= 1e-4
    assert prepack_vision(adapter.load_vision(demo_model_path), "default").num_fused == 0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava"])
def test_every_vision_family_fuses_and_agrees(family):
    """Qwen2.5-VL's vision MLP is gated SiLU (FusedGatedMLP under "prepacked"), Qwen3-VL's and CLIP's are
    fc1/act/fc2; the Qwen towers' patch embeddings are Conv3d patchifiers."""
    from services.models.processing import load_processor
    from services.models.registry import adapter_for
    from services.models.tiny import tiny_model_path
    from tests.services.models.helpers import chat, encode_items, picture, processor_inputs

    path = tiny_model_path(family)
    adapter = adapter_for(path)
    inputs = processor_inputs(load_processor(path), chat(picture(64, 48, 1)))
    # LLaVA's items are whole images ([1, 3, S, S]); encode_items splits the Qwen families' patch rows by grid
    items = encode_items(inputs) or [{"pixel_values": p[None]} for p in inputs["pixel_values"]]
    assert len(items) == 1
    plain, fused = adapter.load_vision(path), adapter.load_vision(path)
    report = prepack_vision(fused, "prepacked")
    kinds = {type(m).__name__ for m in fused.tower.modules()}
    assert report.num_fused > 0
    assert ("FusedGatedMLP" in kinds) == (family == "qwen2_5_vl")
    assert ("GemmPatchEmbed" in kinds) == family.startswith("qwen")
    for want, got in zip(plain.encode(items), fused.encode(items), strict=True):
        assert _rel(got, want) <= 1e-4
