"""Attention over a packed batch of prompt chunks, each reading only its own prompt's KV.

A packed prefill forward runs several prompts (or chunks of them) as ONE sequence of T rows
([1, T, hidden]) through a Hugging Face decoder stack.  The stack's attention modules look up
their function by `config._attn_implementation`; `install(lm)` points it at `packed_attention`
(registered as "epd_prefill"), which does, per layer:

1. write the rows' new keys/values (after rotary) into the KV pool, all segments in one op;
2. per segment (one prompt's chunk, rows [q0, q1) at prompt positions [past, past + n)):
   attention of its queries against that prompt's keys only, causal — its own new rows when it
   has no past (a view, no copy), else its past + new slots gathered from the pool (one copy),
   row i seeing keys 0..past + i: the AVX-512 kernel for spans of up to 1,024 keys
   (services/models/attention_kernel.py), else SDPA with that mask.

So no row ever sees another prompt (block-diagonal by construction) and no mask of T x T is
built.  A forward without a plan (anything else run on the same module: a test's reference
decode, a `generate`) falls through to transformers' own sdpa, mask included, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.models import attention_kernel

if TYPE_CHECKING:
    import torch

    from services.models.base import LanguageModel
    from services.prefill.kv_pool import KVPool

NAME = "epd_prefill"
PLAN_KWARG = "epd_prefill_plan"


@dataclass
class Segment:
    """One prompt's chunk in a packed forward."""

    q0: int                  # first row of the chunk in the packed sequence
    n: int                   # rows (new tokens)
    past: int                # prompt tokens before the chunk whose KV is already in the pool
    slots: torch.Tensor      # pool slots of prompt tokens [0, past + n)
    mask: torch.Tensor | None = field(default=None, repr=False)  # [n, past + n] bool, when past > 0


@dataclass
class PackedPlan:
    """What every layer of one packed forward shares."""

    pool: KVPool
    segments: list[Segment]
    new_slots: torch.Tensor  # pool slots of all T rows, in packed order


def make_plan(pool: KVPool, segments: list[Segment]) -> PackedPlan:
    import torch

    for segment in segments:
        if segment.past:
            keys = torch.arange(segment.past + segment.n, device=segment.slots.device)
            rows = torch.arange(segment.n, device=segment.slots.device) + segment.past
            segment.mask = keys[None, :] <= rows[:, None]
    new_slots = torch.cat([segment.slots[segment.past:] for segment in segments])
    return PackedPlan(pool, segments, new_slots)


def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    plan: PackedPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    import torch.nn.functional as F

    layer = module.layer_idx
    plan.pool.write(layer, plan.new_slots, key[0], value[0])
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    gqa = query.shape[1] != key.shape[1]
    for segment in plan.segments:
        rows = slice(segment.q0, segment.q0 + segment.n)
        if segment.past:
            kv = plan.pool.gather(layer, segment.slots)[:, None]
            seg_key, seg_value = kv[0], kv[1]
        else:
            seg_key, seg_value = key[:, :, rows], value[:, :, rows]
        if attention_kernel.run(query[0, :, rows], seg_key[0], seg_value[0], out[0, rows], segment.past, scaling):
            continue
        result = F.scaled_dot_product_attention(
            query[:, :, rows], seg_key, seg_value, attn_mask=segment.mask, is_causal=segment.mask is None,
            scale=scaling, enable_gqa=gqa)
        out[:, rows] = result.transpose(1, 2)
    return out, None


def install(lm: LanguageModel, native: bool = True) -> None:
    """Route `lm`'s attention through `packed_attention` (sdpa for every forward without a plan); `native`
    builds the AVX-512 kernel for short spans (CPU roles only)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(NAME, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # plan-less forwards get sdpa's own masks
    config = lm.model.config
    current = config._attn_implementation
    if current not in ("sdpa", NAME):
        raise ValueError(f"packed prefill needs a model loaded with sdpa attention, not {current!r}")
    config._attn_implementation = NAME
    if native:
        attention_kernel.load()
