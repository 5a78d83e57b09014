"""RoPE in one C pass (services/models/fused_rope.py): the same bits as transformers' functions, for every family
it is installed into, at the layouts the real forwards pass; only inside `active()`; and a whole prefill forward
and vision forward give the same bits with it as without.  A wrong position is caught by the same comparison."""

from __future__ import annotations

import importlib

import pytest
import torch

from services.models import fused_rope

pytestmark = pytest.mark.skipif(bool(fused_rope.install()), reason="gcc cannot build the RoPE kernel here")


def _module(name: str):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _text_inputs(tokens: int, heads: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # the attention forwards' layout: a [1, T, H * D] projection viewed [1, T, H, D] and transposed to [1, H, T, D]
    q = (torch.randn(1, tokens, heads * dim, generator=gen) * 3).view(1, tokens, heads, dim).transpose(1, 2)
    k = (torch.randn(1, tokens, kv_heads * dim, generator=gen) * 3).view(1, tokens, kv_heads, dim).transpose(1, 2)
    angles = torch.rand(1, tokens, dim, generator=gen) * 50
    return q, k, angles.cos(), angles.sin()


def _vision_inputs(tokens: int, heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, 3 * heads * dim, generator=gen) * 3
    q, k, _ = qkv.reshape(tokens, 3, heads, dim).permute(1, 0, 2, 3).unbind(0)   # the vision forwards' views
    angles = torch.rand(tokens, dim, generator=gen) * 50
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("family", fused_rope.TEXT_MODULES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 4, 2, 16), (67, 16, 4, 64), (5, 8, 8, 128)])
def test_text_rope_is_transformers_bits_inside_active_only(family, tokens, heads, kv_heads, dim):
    module = _module(family)
    original = fused_rope._INSTALLED[family][0]
    q, k, cos, sin = _text_inputs(tokens, heads, kv_heads, dim, seed=tokens)
    want = original(q, k, cos, sin)
    calls = []
    real = fused_rope.rope
    fused_rope.rope = lambda *a: calls.append(1) or real(*a)
    try:
        outside = module.apply_rotary_pos_emb(q, k, cos, sin)
        assert not calls                                   # transformers' own function outside active()
        with fused_rope.active():
            got = module.apply_rotary_pos_emb(q, k, cos, sin)
        assert len(calls) == 2                             # q and k through the kernel
    finally:
        fused_rope.rope = real
    for a, b, c in zip(got, want, outside, strict=True):
        assert a.shape == b.shape and torch.equal(a, b) and torch.equal(c, b)
    # negative control: the kernel given the next token's angles (a position off by one) is not transformers'
    with fused_rope.active():
        shifted = module.apply_rotary_pos_emb(q, k, cos.roll(1, dims=1), sin.roll(1, dims=1))
    assert tokens == 1 or not torch.equal(shifted[0], want[0])


@pytest.mark.parametrize("family", fused_rope.VISION_MODULES)
@pytest.mark.parametrize(("tokens", "heads", "dim"), [(4, 2, 16), (256, 8, 64), (33, 16, 80)])
def test_vision_rope_is_transformers_bits(family, tokens, heads, dim):
    module = _module(family)
    original = fused_rope._INSTALLED[family][1]
    q, k, cos, sin = _vision_inputs(tokens, heads, dim, seed=dim)
    want = original(q, k, cos, sin)
    with fused_rope.active():
        got = module.apply_rotary_pos_emb_vision(q, k, cos, sin)
        shifted = module.apply_rotary_pos_emb_vision(q, k, cos.roll(1, dims=0), sin.roll(1, dims=0))
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert not torch.equal(shifted[0], want[0])


def test_inputs_the_kernel_does_not_take_go_to_transformers():
    module = _module("qwen2_vl")
    q, k, cos, sin = _text_inputs(9, 4, 2, 16, seed=1)
    qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
    calls = []
    real = fused_rope.rope
    fused_rope.rope = lambda *a: calls.append(1) or real(*a)
    try:
        with fused_rope.active():
            got = module.apply_rotary_pos_emb(qb, kb, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
            batched = module.apply_rotary_pos_emb(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                                  cos.expand(2, -1, -1), sin.expand(2, -1, -1))
    finally:
        fused_rope.rope = real
    assert not calls
    want = fused_rope._INSTALLED["qwen2_vl"][0](qb, kb, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    assert torch.equal(got[0], want[0]) and batched[0].shape == (2, 4, 9, 16)


def test_prefill_and_vision_forwards_give_the_same_bits_with_the_kernel(demo_model_path):
    """The whole tiny model: a packed prefill of a one-image prompt (KV and first logits) and the vision forward,
    with the kernel (as the roles run) and without it."""
    from services.models.processing import load_processor
    from services.models.registry import adapter_for
    from services.prefill.engine import PrefillEngine
    from tests.services.models.helpers import chat, encode_items, mm_inputs, picture, processor_inputs

    adapter = adapter_for(demo_model_path)
    vision = adapter.load_vision(demo_model_path, "cpu", "float32")
    lm = adapter.load_language(demo_model_path, "cpu", "float32")
    inputs = processor_inputs(load_processor(demo_model_path), chat(picture(96, 64, seed=3)))
    items = encode_items(inputs)
    calls = []
    real = fused_rope.rope
    fused_rope.rope = lambda *a: calls.append(1) or real(*a)
    try:
        plain = vision.encode(items)
        with fused_rope.active():
            fused = vision.encode(items)
    finally:
        fused_rope.rope = real
    assert calls                                          # the vision forward went through the kernel
    assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))

    token_ids = inputs["input_ids"][0].tolist()
    engine = PrefillEngine(lm, prefix_cache_mb=0)
    calls = []
    real = fused_rope.rope
    fused_rope.rope = lambda *a: calls.append(1) or real(*a)
    try:
        with_kernel = engine.prefill(token_ids, mm_inputs(token_ids, items, plain))
        assert len(calls) == 2 * len(lm.model.layers)      # q and k of every layer went through the kernel
        original = fused_rope.active
        fused_rope.active = lambda on=True: original(False)   # the engine's forward without the kernel
        try:
            without = engine.prefill(token_ids, mm_inputs(token_ids, items, plain))
        finally:
            fused_rope.active = original
        assert len(calls) == 2 * len(lm.model.layers)
    finally:
        fused_rope.rope = real
        engine.close()
    assert torch.equal(with_kernel.kv, without.kv) and torch.equal(with_kernel.first_logits, without.first_logits)
