"""Decode's own forward over the Hugging Face modules' weights, reading KV from the block pool.

Why not the HF decoder stack: its attention wants every row's K/V as one padded tensor
(rows x longest), which is the cost paging removes.  This forward calls the same modules
(norms, q/k/v/o projections, MLP, final norm, LM head — so prepacked linears apply) in the
same order as the HF layer, and replaces only the attention with `PagedAttention` over the
pool.  Supported: decoder layers shaped like Llama / Qwen2 / Qwen2-VL / Qwen2.5-VL (q/k/v
with or without bias) and Qwen3-VL (per-head q/k RMSNorm), full attention, rotate-half RoPE.
M-RoPE at decode is plain 1-D RoPE at position n + rope_delta (every axis holds the same
position, FACTS.md), so cos/sin come from the model's `rotary_emb.inv_freq`.

One step: rows b = 0..B-1 each feed one token at `positions[b]`; its K/V is written at
(write_blocks[b], write_offsets[b]) first, then row b attends to its first `lens[b]` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from services.decode.block_pool import BlockPool
from services.hostcpu import compute_lease, role_cpu
from services.models.base import LanguageModel

AttentionFn = Callable[..., torch.Tensor]


class UnsupportedDecoder(ValueError):
    """The checkpoint's decoder layers are not of a shape the paged forward implements."""


def check_supported(stack: Any) -> None:
    config = stack.config
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or getattr(config, "use_sliding_window", False):
        raise UnsupportedDecoder(f"paged decode supports full attention only, got layer types {set(layer_types)}")
    for index, layer in enumerate(stack.layers):
        attn = getattr(layer, "self_attn", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or not all(hasattr(attn, n) for n in names) or not hasattr(layer, "mlp"):
            raise UnsupportedDecoder(f"decoder layer {index} ({type(layer).__name__}) is not Llama/Qwen shaped")
    if not hasattr(stack.rotary_emb, "inv_freq"):
        raise UnsupportedDecoder(f"{type(stack.rotary_emb).__name__} has no inv_freq")


class PagedDecoder:
    def __init__(self, lm: LanguageModel, pool: BlockPool, attention: AttentionFn) -> None:
        stack = lm.model
        check_supported(stack)
        self.lm, self.pool, self.attention = lm, pool, attention
        self.layers = list(stack.layers)
        self.yielded_s = 0.0   # paused for prompt-side forwards (services/hostcpu/compute_lease.py)
        self.norm = stack.norm
        layout = lm.layout
        first = self.layers[0].self_attn
        self.num_heads = first.config.num_attention_heads
        self.num_kv_heads, self.head_dim = layout.num_kv_heads, layout.head_dim
        self.scale = float(first.scaling)
        self.has_qk_norm = hasattr(first, "q_norm") and hasattr(first, "k_norm")
        rotary = stack.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, head_dim] for int64 positions [B] (as HF's rotary embedding computes them)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.lm.layout.dtype
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, write_blocks: torch.Tensor,
                write_offsets: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                num_blocks: list[int] | None = None, head: bool = True) -> torch.Tensor:
        """Logits [B, vocab] of one decode step (the new tokens' K/V are written into the pool); with
        `head=False` the final-normed hidden states [B, hidden] (the LM head screen takes them)."""
        rows = token_ids.shape[0]
        hidden = self.lm.embed(token_ids[:, None])[:, 0]
        cos, sin = self.rope(positions)
        cos, sin = cos[:, None], sin[:, None]
        follower = compute_lease.follower()
        deadline = time.monotonic() + compute_lease.YIELD_BUDGET_S
        for index, layer in enumerate(self.layers):
            if follower is not None and follower.busy():   # as the fused step: prompt-side forwards go first
                self.yielded_s += follower.pause(deadline, role_cpu.long_prompt_prefilling)
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(rows, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            out = self.write_and_attend(index, q, k, v, write_blocks, write_offsets, tables, lens, num_blocks)
            hidden = hidden + attn.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.norm(hidden)
        return self.lm.lm_head(hidden) if head else hidden

    def write_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         write_blocks: torch.Tensor, write_offsets: torch.Tensor, tables: torch.Tensor,
                         lens: torch.Tensor, num_blocks: list[int] | None = None) -> torch.Tensor:
        """Write the step's K/V of `layer` into the pool, then attend: [B, Hq, D]."""
        keys, values = self.pool.kv[layer, 0], self.pool.kv[layer, 1]
        keys[write_blocks, :, write_offsets] = k
        values[write_blocks, :, write_offsets] = v
        return self.attention(q, keys, values, tables, lens, self.scale, num_blocks)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
