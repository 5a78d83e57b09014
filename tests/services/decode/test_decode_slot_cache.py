"""SlotCache: per-row writes, masks from per-slot lengths, prefill loading, slot moves; the HF model
runs on it unpatched and gives the logits of a per-request DynamicCache."""

from __future__ import annotations

import pytest
import torch

from services.decode.slot_cache import SlotCache
from services.models.base import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, max_model_len=64)


def _kv(length: int, fill: float) -> torch.Tensor:
    return torch.full((2, 2, 2, length, 4), fill)


def test_load_prefill_checks_shape_dtype_and_length():
    cache = SlotCache(LAYOUT, num_slots=2, max_len=16)
    cache.load_prefill(1, _kv(5, 1.0))
    assert cache.lengths == [0, 5]
    assert torch.all(cache.buffer[:, :, 1, :, :5] == 1.0) and torch.all(cache.buffer[:, :, 1, :, 5:] == 0)
    for bad in (torch.zeros(2, 2, 3, 5, 4), _kv(5, 1.0).double(), _kv(16, 1.0)):
        with pytest.raises(ValueError):
            cache.load_prefill(0, bad)


def test_begin_step_positions_mask_and_row_writes():
    cache = SlotCache(LAYOUT, num_slots=3, max_len=16)
    cache.load_prefill(0, _kv(3, 1.0))
    cache.load_prefill(1, _kv(6, 2.0))
    positions, mask = cache.begin_step(2)
    assert positions.tolist() == [3, 6] and cache.lengths[:2] == [4, 7]
    assert mask.shape == (2, 1, 1, 7)
    visible = (mask[:, 0, 0] == 0).tolist()
    assert visible == [[True] * 4 + [False] * 3, [True] * 7]
    keys, values = cache.update(torch.full((2, 2, 1, 4), 9.0), torch.full((2, 2, 1, 4), 8.0), 0)
    assert keys.shape == (2, 2, 7, 4)
    assert keys[0, :, 3].eq(9).all() and keys[1, :, 6].eq(9).all() and values[1, :, 6].eq(8).all()
    assert keys[0, :, 4:].eq(0).all() and keys[1, :, :6].eq(2).all()    # nothing else was touched


def test_move_slot_keeps_rows_contiguous():
    cache = SlotCache(LAYOUT, num_slots=3, max_len=16)
    for slot, length in enumerate((3, 5, 7)):
        cache.load_prefill(slot, _kv(length, float(slot + 1)))
    cache.move_slot(2, 0)
    assert cache.lengths == [7, 5, 0]
    assert cache.buffer[:, :, 0, :, :7].eq(3.0).all()


def test_model_on_slot_cache_matches_dynamic_cache(tiny):
    from transformers import DynamicCache

    lm, hf = tiny.lm, tiny.hf
    prompts = [tiny.chat_ids(t) for t in ("one", "a somewhat longer prompt here")]
    pre = [tiny.prefill_text(ids) for ids in prompts]
    cache = SlotCache(lm.layout, num_slots=2, max_len=128)
    for slot, p in enumerate(pre):
        cache.load_prefill(slot, p.kv)
    with torch.inference_mode():
        positions, mask = cache.begin_step(2)
        ids = torch.tensor([[p.first_token] for p in pre])
        out = lm.model(inputs_embeds=lm.embed(ids), position_ids=lm.decode_position_ids(positions),
                       attention_mask=mask, cache=cache, use_cache=True)
        batched = lm.lm_head(out.last_hidden_state[:, -1])
        for row, (p, prompt) in enumerate(zip(pre, prompts, strict=True)):
            full = torch.tensor([prompt + [p.first_token]])
            hf.model.rope_deltas = None
            alone = hf(input_ids=full, cache=DynamicCache(config=hf.config.text_config)).logits[0, -1]
            torch.testing.assert_close(batched[row], alone, atol=2e-4, rtol=1e-4)
