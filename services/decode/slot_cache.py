"""A transformers `Cache` for continuous batching: one preallocated KV row per slot.

The engine owns a `SlotCache`; each request occupies one row of preallocated
[num_slots, num_kv_heads, max_len, head_dim] buffers per layer.  Active rows are
kept contiguous (rows 0..num_active-1): when a request leaves, the last active
row moves into the freed one, so a step attends over a slice, never a gather.

Per step the engine calls `begin_step(num_active)`, which returns the write
position of every active row (= its tokens so far) and the explicit 4-D
additive mask [B, 1, 1, kv_len]; the model's attention layers then call
`update(k, v, layer_idx)`, which writes each row at its own position and
returns views of the active rows.  Passing a 4-D mask makes transformers 5.x
use it as is; `StaticCache` cannot do this since it has one shared write
column for all rows.

What transformers 5.24 touches on a decode forward with position_ids and a
4-D mask (measured): `is_sliding` / `is_linear` / `is_dummy` (create_causal_mask
looks for the first full-attention layer, then returns our mask) and
`update(k, v, layer_idx)` once per layer.  `get_seq_length` / `get_mask_sizes`
are implemented for callers that build masks or positions themselves.
Attention must honour an explicit mask: sdpa and eager do (checked).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from services.models.base import KVLayout


class _StepState:
    """What all layers of one forward share: which rows write where, and how far to attend."""

    def __init__(self) -> None:
        self.num_active = 0
        self.kv_len = 0
        self.write_pos: torch.Tensor | None = None   # [B] int64
        self.rows: torch.Tensor | None = None        # [B] int64 (arange)


class SlotLayer(CacheLayerMixin):
    """One layer's K/V buffers; reads the shared step state set by `SlotCache.begin_step`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, step: _StepState) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self._keys, self._values = keys, values   # typed non-optional views of the same buffers
        self.device = keys.device
        self.is_initialized = True
        self._step = step

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # buffers are preallocated

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step
        if key_states.shape[0] != step.num_active or key_states.shape[2] != 1:
            raise RuntimeError(f"SlotCache expects [num_active={step.num_active}, H, 1, D] per step, "
                               f"got {tuple(key_states.shape)}")
        # Advanced indices (rows, :, pos) select a [B, H, D] block: each row at its own position.
        self._keys[step.rows, :, step.write_pos] = key_states[:, :, 0]
        self._values[step.rows, :, step.write_pos] = value_states[:, :, 0]
        rows, length = step.num_active, step.kv_len
        return self._keys[:rows, :, :length], self._values[:rows, :, :length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._step.kv_len, 0

    def get_seq_length(self) -> int:
        return max(self._step.kv_len - 1, 0)

    def get_max_length(self) -> int:
        return self._keys.shape[2]

    def reset(self) -> None:
        return None  # stale rows are harmless: the mask hides everything past a row's length


class SlotCache(Cache):
    """Preallocated per-slot KV for all layers; `lengths[row]` is that row's tokens so far."""

    def __init__(self, layout: KVLayout, num_slots: int, max_len: int, device: Any = "cpu") -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots}, {max_len}")
        # One allocation: [num_layers, 2 (k/v), slots, heads, max_len, head_dim]; moving a slot is one copy.
        shape = (layout.num_layers, 2, num_slots, layout.num_kv_heads, max_len, layout.head_dim)
        self.buffer = torch.zeros(shape, dtype=layout.dtype, device=device)
        self._step = _StepState()
        self._slot_layers = [SlotLayer(self.buffer[i, 0], self.buffer[i, 1], self._step)
                             for i in range(layout.num_layers)]
        super().__init__(layers=list(self._slot_layers))
        self.layout = layout
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self._arange = torch.arange(max_len, device=device)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def load_prefill(self, slot: int, kv: torch.Tensor) -> None:
        """Copy a prefilled KV [num_layers, 2, num_kv_heads, L, head_dim] into `slot`."""
        expected = (self.layout.num_layers, 2, self.layout.num_kv_heads)
        if kv.dim() != 5 or tuple(kv.shape[:3]) != expected or kv.shape[4] != self.layout.head_dim:
            raise ValueError(f"kv must be [{expected[0]}, 2, {expected[2]}, L, {self.layout.head_dim}], "
                             f"got {tuple(kv.shape)}")
        if kv.dtype != self.buffer.dtype:
            # A silent cast changes tokens (FACTS): prefill must hand over KV in the model dtype.
            raise ValueError(f"kv dtype {kv.dtype} != cache dtype {self.buffer.dtype}")
        length = kv.shape[3]
        if not 0 < length < self.max_len:
            raise ValueError(f"kv length {length} must be in [1, {self.max_len - 1}]")
        self.buffer[:, :, slot, :, :length].copy_(kv)
        self.lengths[slot] = length

    def move_slot(self, src: int, dst: int) -> None:
        """Move row `src` into row `dst` (to keep active rows contiguous)."""
        if src != dst:
            length = self.lengths[src]
            self.buffer[:, :, dst, :, :length].copy_(self.buffer[:, :, src, :, :length])
            self.lengths[dst] = length
        self.lengths[src] = 0

    def begin_step(self, num_active: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare one decode step of rows 0..num_active-1.

        Returns (positions [B] int64: each row's tokens so far = where its new token is written,
        mask [B, 1, 1, kv_len] additive float in the cache dtype).  Advances every row's length by one.
        """
        lengths = self.lengths[:num_active]
        kv_len = max(lengths) + 1
        if kv_len > self.max_len:
            raise RuntimeError(f"a slot would exceed max_len {self.max_len}")
        positions = torch.tensor(lengths, dtype=torch.long, device=self.device)
        step = self._step
        step.num_active, step.kv_len, step.write_pos = num_active, kv_len, positions
        step.rows = self._arange[:num_active]
        for row in range(num_active):
            self.lengths[row] += 1
        return positions, self.build_mask(positions, kv_len)

    def build_mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Additive mask: row b sees columns 0..positions[b] (its past and the token written now)."""
        visible = self._arange[:kv_len].unsqueeze(0) <= positions.unsqueeze(1)
        dtype = self.buffer.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[:, None, None, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._slot_layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._slot_layers[layer_idx].get_seq_length()
