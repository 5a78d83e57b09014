"""The CUDA decode step's forward: transformers' modules, paged flex attention, everything in device buffers.

One step of `rows` rows reads only static device buffers (`StepBuffers`: token ids, positions, where each new
K/V goes, block tables, lengths and the count of real rows) and writes only the pool and its outputs (logits
and their argmax).  No host tensor is made, no value comes back to the host, no shape depends on data: the
whole step can be captured as one CUDA graph per batch bucket (services/decode/gpu_graphs.py), and the host's
only wait per step is for the sampled tokens (services/decode/gpu_runner.py).

Layers: the same modules and order as the CPU paged forward (services/decode/paged_forward.py: Llama / Qwen2 /
Qwen2-VL / Qwen2.5-VL / Qwen3-VL shaped, 1-D RoPE at n + rope_delta), with the K/V write and attention of each
layer as `index_copy_` into the heads-major pool and `flex_paged.attend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.decode.block_pool import BlockPool
from services.decode.flex_paged import PagedMask, attend, flex_function
from services.decode.gpu_budget import INT32_ELEMENTS
from services.decode.paged_forward import check_supported, rotate_half
from services.models.base import LanguageModel

IDS, POS, SLOT = range(3)   # rows of the int64 step buffer


@dataclass
class StepBuffers:
    """The step's inputs, [max_rows] per row (rows past the step's count are padding: gpu_graphs.py), in three
    tensors so the host sends them in three copies: `step64` [3, max_rows] int64 (token ids, RoPE positions
    n + rope_delta, the pool token each row's new K/V goes to: block * block_size + offset), `meta` [max_rows + 1]
    int32 (tokens each row attends to, its new one included; then the count of real rows) and `tables`
    [max_rows, max_blocks] int32 (block tables).  The host side (services/decode/gpu_runner.py) has the same."""

    step64: torch.Tensor
    meta: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, max_blocks: int, device: torch.device | str, pin: bool = False
                 ) -> StepBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(zeros(3, max_rows), zeros(max_rows + 1, dtype=torch.int32),
                   zeros(max_rows, max_blocks, dtype=torch.int32))

    @property
    def lens(self) -> torch.Tensor:
        return self.meta[:-1]

    @property
    def count(self) -> torch.Tensor:
        return self.meta[-1:]

    def send(self, host: StepBuffers, rows: int) -> None:
        """Copy the host's buffers of the first `rows` rows here (asynchronous from pinned memory)."""
        self.step64.copy_(host.step64, non_blocking=True)
        self.meta.copy_(host.meta, non_blocking=True)
        self.tables[:rows].copy_(host.tables[:rows], non_blocking=True)


class GpuDecoder:
    def __init__(self, lm: LanguageModel, pool: BlockPool, max_rows: int, max_blocks: int) -> None:
        if not pool.heads_major:
            raise ValueError("the CUDA decode step needs a heads-major block pool")
        if pool.kv[0, 0].numel() > INT32_ELEMENTS:   # flex's kernels address a layer's keys with 32-bit offsets
            raise ValueError(f"a KV pool of {pool.num_blocks} blocks is beyond flex attention's 32-bit offsets "
                             "(services/decode/gpu_budget.py pool_blocks caps it)")
        stack = lm.model
        check_supported(stack)
        self.lm, self.pool = lm, pool
        self.layers = list(stack.layers)
        self.norm = stack.norm
        first = self.layers[0].self_attn
        self.num_heads = first.config.num_attention_heads
        self.num_kv_heads, self.head_dim = lm.layout.num_kv_heads, lm.layout.head_dim
        self.scale = float(first.scaling)
        self.has_qk_norm = hasattr(first, "q_norm") and hasattr(first, "k_norm")
        rotary = stack.rotary_emb
        self.inv_freq = rotary.inv_freq.float().to(pool.kv.device)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.device = pool.kv.device
        self.buffers = StepBuffers.allocate(max_rows, max_blocks, self.device)
        b = self.buffers
        self.mask = PagedMask(pool.num_blocks + 1, pool.block_size, b.tables, b.lens, b.count, pool.scratch_block)
        self.flex = flex_function(self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, head_dim] (as transformers' rotary embedding computes them), in the model dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.lm.layout.dtype
        return ((emb.cos() * self.rope_scaling).to(dtype)[:, None],
                (emb.sin() * self.rope_scaling).to(dtype)[:, None])

    @torch.inference_mode()
    def forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [rows, vocab], their argmax [rows]) of one step over the first `rows` rows of the buffers."""
        b = self.buffers
        self.mask.update(rows)
        mask = self.mask.for_rows(rows)
        slots = b.step64[SLOT, :rows]
        hidden = self.lm.embed(b.step64[IDS, :rows, None])[:, 0]
        cos, sin = self.rope(b.step64[POS, :rows])
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(rows, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys, values = self.pool.kv[index, 0], self.pool.kv[index, 1]   # [Hkv, blocks, block_size, D]
            keys.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, k.transpose(0, 1))
            values.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, v.transpose(0, 1))
            out = attend(self.flex, q, keys, values, mask, self.scale)
            hidden = hidden + attn.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.lm.lm_head(self.norm(hidden))
        return logits, logits.argmax(dim=-1)
