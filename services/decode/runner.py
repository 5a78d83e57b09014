"""The model side of a decode step: one forward for all active slots, then sampling.

Owned and called only by the engine's worker thread.  Uses the LanguageModel
contract (services.models.base): `embed`, `model` (the HF decoder stack, fed
inputs_embeds, position_ids, an explicit 4-D mask and our `SlotCache`),
`lm_head`, `decode_position_ids`, `layout`.  Row i of every tensor is slot i.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from services.compute_metrics import compute_timer
from services.decode.sampler import RowSampling, Sampler
from services.decode.slot_cache import SlotCache
from services.models.base import LanguageModel


class DecodeRunner:
    def __init__(self, lm: LanguageModel, num_slots: int, max_model_len: int, sampler: Sampler) -> None:
        self.lm = lm
        self.device = _device_of(lm)
        self.cache = SlotCache(lm.layout, num_slots, max_model_len, device=self.device)
        self.sampler = sampler
        self._cache_kwarg = _cache_kwarg(lm.model)

    def check_prefill(self, kv: torch.Tensor, prompt_len: int) -> None:
        """Raises ValueError unless kv can be loaded for a prompt of `prompt_len` tokens."""
        layout = self.lm.layout
        expected = (layout.num_layers, 2, layout.num_kv_heads, prompt_len, layout.head_dim)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != expected:
            shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(f"kv must have shape {expected}, got {shape}")
        if kv.dtype != layout.dtype:
            raise ValueError(f"kv dtype must be the model dtype {layout.dtype}, got {kv.dtype}")

    def load(self, row: int, kv: torch.Tensor) -> None:
        self.cache.load_prefill(row, kv)

    def move(self, src: int, dst: int) -> None:
        self.cache.move_slot(src, dst)

    def clear(self, num_rows: int) -> None:
        for row in range(num_rows):
            self.cache.lengths[row] = 0

    def step(self, last_tokens: Sequence[int], rope_deltas: Sequence[int], rows: Sequence[RowSampling]
             ) -> list[int]:
        """Feed each row's last token at its own position; returns one sampled token per row."""
        with compute_timer("decode_step"):
            return self._step(last_tokens, rope_deltas, rows)

    @torch.inference_mode()
    def _step(self, last_tokens: Sequence[int], rope_deltas: Sequence[int], rows: Sequence[RowSampling]
              ) -> list[int]:
        num_rows = len(last_tokens)
        positions, mask = self.cache.begin_step(num_rows)
        deltas = torch.tensor(rope_deltas, dtype=torch.long, device=self.device)
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).view(num_rows, 1)
        out = self.lm.model(inputs_embeds=self.lm.embed(ids),
                            position_ids=self.lm.decode_position_ids(positions + deltas),
                            attention_mask=mask, use_cache=True, **{self._cache_kwarg: self.cache})
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        logits = self.lm.lm_head(hidden[:, -1])
        return self.sampler.sample(logits, rows, inplace=True)


def _device_of(lm: LanguageModel) -> torch.device:
    for module in (lm.lm_head, lm.model):
        for parameter in getattr(module, "parameters", lambda: iter(()))():
            return parameter.device
    return torch.device("cpu")


def _cache_kwarg(model: Any) -> str:
    # transformers 5.x renamed past_key_values to cache (the old name still works, with a warning).
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
