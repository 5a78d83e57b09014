"""The LanguageModel contract a continuous-batching decoder relies on.

A minimal slot cache (each row writes at its own position in preallocated
buffers), an explicit 4-D additive mask [B, 1, 1, max_len], per-row positions
from `decode_position_ids(index + rope_delta)`, and a request that joins while
another is running: every request's tokens equal HF `generate`.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache, DynamicLayer

from services.prefill.engine import PrefillEngine
from tests.services.models.helpers import CHATS, generate_reference, prefill_chat, processor_inputs

NEW_TOKENS = 10


class SlotCache(Cache):
    """[slots, kv_heads, max_len, head_dim] per layer; row i of a step writes at `write_at[i]`."""

    def __init__(self, layout, num_slots: int, max_len: int) -> None:
        super().__init__(layers=[DynamicLayer() for _ in range(layout.num_layers)])
        shape = (layout.num_layers, num_slots, layout.num_kv_heads, max_len, layout.head_dim)
        self.keys = torch.zeros(shape, dtype=layout.dtype)
        self.values = torch.zeros(shape, dtype=layout.dtype)
        self.write_at = torch.zeros(num_slots, dtype=torch.long)

    def load(self, slot: int, kv: torch.Tensor) -> None:
        length = kv.shape[3]
        self.keys[:, slot, :, :length] = kv[:, 0]
        self.values[:, slot, :, :length] = kv[:, 1]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rows = torch.arange(key_states.shape[0])
        self.keys[layer_idx, rows, :, self.write_at[rows]] = key_states[:, :, 0]
        self.values[layer_idx, rows, :, self.write_at[rows]] = value_states[:, :, 0]
        return self.keys[layer_idx, :len(rows)], self.values[layer_idx, :len(rows)]


class Request:
    def __init__(self, result) -> None:
        self.result = result
        self.tokens = [int(result.first_logits.argmax())]

    def index(self) -> int:
        """Sequence index of the token fed next (its KV lands there)."""
        return self.result.num_prompt_tokens + len(self.tokens) - 1


def step(lm, cache: SlotCache, active: list[Request], max_len: int) -> None:
    indices = torch.tensor([request.index() for request in active])
    cache.write_at[:len(active)] = indices
    mask = torch.full((len(active), 1, 1, max_len), torch.finfo(lm.layout.dtype).min, dtype=lm.layout.dtype)
    for row, index in enumerate(indices.tolist()):
        mask[row, 0, 0, :index + 1] = 0
    deltas = torch.tensor([request.result.rope_delta for request in active])
    embeds = lm.embed(torch.tensor([[request.tokens[-1]] for request in active]))
    with torch.no_grad():
        out = lm.model(inputs_embeds=embeds, position_ids=lm.decode_position_ids(indices + deltas),
                       attention_mask=mask, cache=cache, use_cache=True)
        next_ids = lm.lm_head(out.last_hidden_state[:, -1]).argmax(-1).tolist()
    for request, token in zip(active, next_ids, strict=True):
        request.tokens.append(token)


@pytest.fixture(scope="module")
def reference_model(model_path):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(model_path)).eval()


def test_batched_slot_decode_matches_generate(processor, vision, lm, reference_model):
    engine, max_len = PrefillEngine(lm), 512
    inputs = [processor_inputs(processor, CHATS[name]()) for name in ("one_image", "text", "two_images")]
    expected = [generate_reference(reference_model, item, NEW_TOKENS) for item in inputs]
    requests = [Request(prefill_chat(vision, engine, item)) for item in inputs]
    cache = SlotCache(lm.layout, num_slots=3, max_len=max_len)
    for slot, request in enumerate(requests[:2]):
        cache.load(slot, request.result.kv)
    for _ in range(3):  # the third request joins late
        step(lm, cache, requests[:2], max_len)
    cache.load(2, requests[2].result.kv)
    while any(len(request.tokens) < NEW_TOKENS for request in requests):
        step(lm, cache, requests, max_len)
    assert [request.tokens[:NEW_TOKENS] for request in requests] == expected
