"""Swapped linears (oneDNN prepacked, panel): same tokens as the plain model, logits within 1e-4, one copy of
each weight."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from services.kernels import loader
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


def test_auto_times_both_kernels_on_the_model_weights_the_head_apart(demo_model_path):
    lm = _load(demo_model_path)
    report = prepack_language(lm, "auto", rows=(4, 64), head_rows=(1, 16))
    head = report.head
    assert head is not None
    for part, timed in ((report, {"64x64@4", "64x64@64"}), (head, {"lm_head@1", "lm_head@16"})):
        assert part.kernel in ("panel", "prepacked", "default") and part.speedup is not None and part.speedup > 0
        assert timed <= set(part.timings_ms) and not any("lm_head" in key for key in set(part.timings_ms) - timed)
        assert all(set(ms) == {"default_ms", "prepacked_ms", "panel_ms"} for ms in part.timings_ms.values())
        assert set(part.speedups) == {"prepacked", "panel"}
        if part.kernel != "default":
            assert part.speedup == max(part.speedups.values()) >= 1.05
            assert part.max_rel_diff is not None and part.max_rel_diff <= 1e-4
    assert isinstance(lm.lm_head, PackedLinear) == (head.kernel == "prepacked")
    assert isinstance(lm.lm_head, PanelLinear) == (head.kernel == "panel")
    down = lm.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) == (report.kernel == "prepacked")
    assert isinstance(down, PanelLinear) == (report.kernel == "panel")
    layers = 7 * len(lm.model.layers)
    assert report.num_swapped == (layers if report.kernel != "default" else 0) + (head.kernel != "default")
    assert f"linear kernel {report.kernel} " in report.line() and f"lm_head {head.kernel}" in report.line()


def test_lm_head_screen_on_keeps_the_head_on_panels_whatever_auto_times(demo_model_path):
    """--lm-head-screen on reads a panel head: under --linear-kernel auto the head is not timed onto oneDNN (a
    small head can time faster there, and the role then refused to start); the stack is still timed."""
    from services.models.head_screen import build_screen, screen_head_mode

    assert screen_head_mode("auto", "on") == "panel"
    assert screen_head_mode("auto", "auto") is None and screen_head_mode("prepacked", "on") is None
    # auto keeps a head the int8 screen will take on panels (greedy and temperature rows never run it)
    wide, narrow = nn.Linear(1024, 4096, bias=False), nn.Linear(64, 4096, bias=False)
    assert screen_head_mode("auto", "auto", wide) == ("panel" if loader.expected("head_int8") else None)
    assert screen_head_mode("auto", "auto", narrow) is None and screen_head_mode("auto", "off", wide) is None
    assert screen_head_mode("auto", "auto", wide.to(torch.bfloat16)) is None   # bfloat16 layers: not a panel head
    lm = _load(demo_model_path)
    report = prepack_language(lm, "auto", rows=(4, 64), head_rows=(1, 16), head_mode=screen_head_mode("auto", "on"))
    assert isinstance(lm.lm_head, PanelLinear) and report.head is not None and report.head.kernel == "panel"
    assert report.kernel in ("panel", "prepacked", "default") and report.speedups   # the stack was timed
    screen, line = build_screen(lm.lm_head, "on")
    assert screen is not None and line.enabled


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


def test_start_up_timings_take_turns_across_processes(tmp_path):
    """Roles of one machine time their kernels one at a time (timed side by side, their threads' barriers
    made every OpenMP kernel look slow); a holder that never lets go delays the next by `wait_s` at most."""
    import time

    from services.models.timing_lock import timing_lock
    from tests.support.timing_holder import lock_held

    with lock_held(tmp_path):
        started = time.monotonic()
        with timing_lock(wait_s=0.5) as taken:
            waited = time.monotonic() - started
        assert taken is False and 0.5 <= waited < 5
    with timing_lock(wait_s=120) as taken:   # the lock went with the killed holder
        assert taken is True


def test_serial_batch_sizes_are_timed_on_one_thread():
    from services.models import prepack

    seen: dict[int, set[int]] = {}
    called: set[int] = set()

    class Recording(nn.Linear):
        def forward(self, x):
            seen.setdefault(x.shape[0], set()).add(torch.get_num_threads())
            called.add(id(self))
            return super().forward(x)

    layers = [Recording(64, 32) for _ in range(2)]   # two layers of one shape: timed in turn, as a forward reads them
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        report = prepack._measure(  # noqa: SLF001 - the timing itself is under test
            [("w", layers, (1, 4, 8))], [k for k in prepack.KERNELS if prepack._kernel_applies(k)], serial_rows=4)
        assert seen == {1: {1}, 4: {1}, 8: {2}} and torch.get_num_threads() == 2
        assert called == {id(layer) for layer in layers}
        assert set(report.timings_ms) == {"w@1", "w@4", "w@8"}
    finally:
        torch.set_num_threads(before)


def test_bfloat16_weights_over_a_float32_model_always_swap(demo_model_path):
    """decode's --dtype bfloat16: auto times both kernels keeping bfloat16 weights (never F.linear, which would
    keep float32 ones) at the bfloat16 tolerance; with panels the model is the float32 model over the weights
    rounded to bfloat16 (same greedy tokens, logits within 1e-5); "default" is refused."""
    from services.models.packed_linear import MAX_REL_DIFF_BF16, bf16_packable

    ids = list(range(100, 140))
    lm = _load(demo_model_path)
    want, want_logits = _greedy(lm, ids, 1)
    report = prepack_language(lm, "auto", rows=(1, 4), head_rows=(1, 4), weight_dtype=torch.bfloat16)
    kernels = {"panel", "prepacked"} if bf16_packable() else {"panel"}
    assert report.kernel in kernels and report.head is not None and report.head.kernel in kernels
    assert set(report.speedups) == kernels and report.max_rel_diff <= MAX_REL_DIFF_BF16
    assert "(bfloat16 weights, mode auto" in report.line()
    down = lm.model.layers[0].mlp.down_proj
    if report.kernel == "panel":
        assert down.weight.dtype == torch.bfloat16
    else:
        assert down.cast == torch.bfloat16
    got, got_logits = _greedy(lm, ids, 1)
    assert 0 < float((got_logits - want_logits).abs().max() / want_logits.abs().max()) <= MAX_REL_DIFF_BF16

    rounded = _load(demo_model_path)
    with torch.inference_mode():
        for module in [*rounded.model.modules(), rounded.lm_head]:
            if isinstance(module, nn.Linear):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    want, want_logits = _greedy(rounded, ids, 6)
    panels = _load(demo_model_path)
    prepack_language(panels, "panel", weight_dtype=torch.bfloat16)
    assert panels.model.layers[0].mlp.down_proj.weight.dtype == panels.lm_head.weight.dtype == torch.bfloat16
    got, got_logits = _greedy(panels, ids, 6)
    assert got == want
    assert float((got_logits - want_logits).abs().max() / want_logits.abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="need a swapped kernel, not --linear-kernel default"):
        prepack_language(_load(demo_model_path), "default", weight_dtype=torch.bfloat16)


def test_a_bfloat16_model_is_prepacked_at_the_bfloat16_tolerance_where_the_cpu_can(demo_model_path):
    """Where oneDNN has bf16 arithmetic the model's bf16 linears are packed (outputs within the bf16 tolerance);
    elsewhere nothing is packable and the model stays on F.linear, said so in the report."""
    from services.models.packed_linear import MAX_REL_DIFF_BF16, bf16_packable
    from services.models.registry import adapter_for

    lm = adapter_for(demo_model_path).load_language(demo_model_path, "cpu", "bfloat16", 512)
    plain = adapter_for(demo_model_path).load_language(demo_model_path, "cpu", "bfloat16", 512)
    if not bf16_packable():
        report = prepack_language(lm, "auto")
        assert report.kernel == "default" and report.reason == "nothing packable"
        assert type(lm.model.layers[0].mlp.up_proj) is nn.Linear
        return
    report = prepack_language(lm, "prepacked")
    assert report.kernel == "prepacked" and isinstance(lm.model.layers[0].mlp.up_proj, PackedLinear)
    with pytest.raises(ValueError, match="linear kernel 'panel' does not run torch.bfloat16 layers here"):
        prepack_language(plain, "panel")
    ids = list(range(100, 140))
    got, got_logits = _greedy(lm, ids, 4)
    want, want_logits = _greedy(plain, ids, 4)
    assert got_logits.dtype == torch.bfloat16
    assert float((got_logits - want_logits).abs().max() / want_logits.abs().max()) <= MAX_REL_DIFF_BF16
