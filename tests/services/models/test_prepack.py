"""Swapped linears (oneDNN prepacked, panel): same tokens as the plain model, logits within 1e-4, one copy of
each weight."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from services.models.panel_linear import PanelLinear
from services.models.prepack import MODES, PackedLinear, prepack_language, prepack_vision


def _load(path):
    from services.models.registry import adapter_for

    return adapter_for(path).load_language(path, "cpu", "float32", 512)


@torch.inference_mode()
def _greedy(lm, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens through the LanguageModel contract (prefill forward + DynamicCache steps), and the
    first step's logits."""
    from transformers import DynamicCache

    cache, tokens, first = DynamicCache(), [], None
    inputs = lm.prefill_inputs(ids, [])
    out = lm.model(inputs_embeds=inputs.inputs_embeds, position_ids=inputs.position_ids, cache=cache, use_cache=True)
    for step in range(steps):
        logits = lm.lm_head(out.last_hidden_state[:, -1])
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        position = torch.tensor([len(ids) + step])
        out = lm.model(inputs_embeds=lm.embed(torch.tensor([[tokens[-1]]])), cache=cache, use_cache=True,
                       position_ids=lm.decode_position_ids(position))
    return tokens, first


@pytest.mark.parametrize("kernel, cls", [("prepacked", PackedLinear), ("panel", PanelLinear)])
def test_swapped_gives_the_same_tokens_and_frees_the_plain_weights(demo_model_path, kernel, cls):
    plain, packed = _load(demo_model_path), _load(demo_model_path)
    head_weight = weakref.ref(packed.lm_head.weight)
    layer_weight = weakref.ref(packed.model.layers[0].mlp.down_proj.weight)
    report = prepack_language(packed, kernel)
    gc.collect()
    assert head_weight() is None and layer_weight() is None      # one copy of each weight: the swapped one
    assert isinstance(packed.lm_head, cls) and isinstance(packed.model.layers[0].mlp.down_proj, cls)
    assert report.kernel == kernel and report.extra_bytes == 0
    assert report.num_swapped == 1 + 7 * len(packed.model.layers)  # q k v o gate up down per layer, + head
    ids = list(range(1000, 1040))
    want, want_logits = _greedy(plain, ids, 12)
    got, got_logits = _greedy(packed, ids, 12)
    assert got == want
    assert float((got_logits - want_logits).abs().max() / want_logits.abs().max()) <= 1e-4


def test_a_tied_head_keeps_the_embedding_and_counts_the_packed_copy():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(64, 16)
            self.proj = nn.Linear(16, 16)

    class Tied:
        model = Stack()
        lm_head = nn.Linear(16, 64, bias=False)

    lm = Tied()
    lm.lm_head.weight = lm.model.embed_tokens.weight
    x = torch.randn(3, 16)
    want = lm.lm_head(x)
    report = prepack_language(lm, "prepacked")
    assert report.extra_bytes == 64 * 16 * 4 and report.num_swapped == 2
    assert isinstance(lm.model.proj, PackedLinear)
    with torch.inference_mode():
        assert torch.allclose(lm.lm_head(x), want, rtol=1e-5, atol=1e-6)
        assert lm.model.embed_tokens(torch.tensor([5])).shape == (1, 16)    # the embedding still reads it


def test_auto_times_both_kernels_on_the_model_weights(demo_model_path):
    lm = _load(demo_model_path)
    report = prepack_language(lm, "auto")
    assert report.kernel in ("panel", "prepacked", "default") and report.speedup is not None and report.speedup > 0
    assert "lm_head@1" in report.timings_ms and "lm_head@16" in report.timings_ms
    assert set(report.timings_ms["lm_head@1"]) == {"default_ms", "prepacked_ms", "panel_ms"}   # all three timed
    assert set(report.speedups) == {"prepacked", "panel"}
    if report.kernel != "default":
        assert report.speedup == max(report.speedups.values()) >= 1.05
        assert report.max_rel_diff is not None and report.max_rel_diff <= 1e-4
    assert isinstance(lm.lm_head, PackedLinear) == (report.kernel == "prepacked")
    assert isinstance(lm.lm_head, PanelLinear) == (report.kernel == "panel")
    assert "linear kernel" in report.line()


def test_default_leaves_the_model_alone_and_unknown_modes_are_refused(demo_model_path):
    lm = _load(demo_model_path)
    head = lm.lm_head
    assert prepack_language(lm, "default").kernel == "default" and lm.lm_head is head
    with pytest.raises(ValueError, match="supported: auto, panel, prepacked, default"):
        prepack_language(lm, "fastest")
    from services.config import LINEAR_KERNELS

    assert LINEAR_KERNELS == MODES


def test_prepacked_vision_tower_embeddings_agree(demo_model_path):
    import numpy as np
    from PIL import Image

    from services.models.processing import load_processor
    from services.models.registry import adapter_for

    adapter = adapter_for(demo_model_path)
    image = Image.fromarray((np.random.RandomState(3).rand(56, 84, 3) * 255).astype("uint8"))
    item = dict(load_processor(demo_model_path).image_processor(images=[image], return_tensors="pt"))
    plain, packed = adapter.load_vision(demo_model_path), adapter.load_vision(demo_model_path)
    report = prepack_vision(packed, "prepacked")
    assert report.num_swapped > 0
    want, got = plain.encode([item])[0], packed.encode([item])[0]
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
