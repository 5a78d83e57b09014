"""The prefill engine: one prompt in, first-token logits and its KV out.

Transport-free; the prefill role's serving core calls `prefill` from any
thread (a lock serialises forwards: the model is shared and CPU forwards
already use every core).  The KV comes back in the wire layout decode expects,
[num_layers, 2, num_kv_heads, L, head_dim] in the model dtype on the model's
device, together with the rope_delta decode needs for its positions.

With a `PrefixCache`, the leading full blocks already seen (same salt, same
tokens, same images) are taken from it and only the rest of the prompt runs
through the model; at least one token always runs, since its logits are the
result.  Tokens are the same with or without hits (logits agree to float
rounding: shorter matmuls sum in another order).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.compute_metrics import compute_timer
from services.models.base import LanguageModel, MultiModalInput
from services.models.kv import cache_from_kv, kv_from_cache, new_cache
from services.prefill.prefix_cache import PrefixCache, block_hashes

if TYPE_CHECKING:
    import torch


@dataclass
class PrefillResult:
    first_logits: torch.Tensor   # [vocab] float32: logits for the token after the prompt
    kv: torch.Tensor             # [num_layers, 2, num_kv_heads, L, head_dim], model dtype
    rope_delta: int              # decode position of sequence index n is n + rope_delta
    num_prompt_tokens: int       # L
    num_cached_tokens: int = 0   # leading tokens whose KV came from the prefix cache


class PrefillEngine:
    """Runs the decoder stack over whole prompts; thread-safe."""

    def __init__(self, lm: LanguageModel, prefix_cache: PrefixCache | None = None) -> None:
        self.lm = lm
        self.prefix_cache = prefix_cache
        self._lock = threading.Lock()
        self.num_prefills = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def prefill(self, token_ids: list[int], mm_items: list[MultiModalInput] | None = None,
                cache_salt: str | None = None) -> PrefillResult:
        """Prefill one prompt. Raises ValueError (InvalidMultiModalInput) for items that do not fit it."""
        import torch

        self._check_length(token_ids)
        items = mm_items or []
        with self._lock, torch.no_grad(), compute_timer("prefill"):
            inputs = self.lm.prefill_inputs(token_ids, items)
            keys, hits = self._lookup(token_ids, items, cache_salt)
            cached = sum(block.shape[3] for block in hits)
            cache = cache_from_kv(torch.cat(hits, dim=3)) if hits else new_cache()
            out = self.lm.model(inputs_embeds=inputs.inputs_embeds[:, cached:], cache=cache, use_cache=True,
                                position_ids=inputs.position_ids[..., cached:], **inputs.forward_kwargs(cached))
            logits = self.lm.lm_head(out.last_hidden_state[:, -1])[0].float()
            kv = kv_from_cache(cache)
            if self.prefix_cache is not None:
                self.prefix_cache.insert(keys, kv, first=len(hits))
            self._count(len(token_ids), cached)
        return PrefillResult(first_logits=logits, kv=kv, rope_delta=inputs.rope_delta,
                             num_prompt_tokens=len(token_ids), num_cached_tokens=cached)

    def _check_length(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prefill needs at least one prompt token")
        if len(token_ids) > self.lm.layout.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens exceeds max_model_len "
                             f"{self.lm.layout.max_model_len}")

    def _lookup(self, token_ids: list[int], items: list[MultiModalInput],
                cache_salt: str | None) -> tuple[list[bytes], list[torch.Tensor]]:
        if self.prefix_cache is None:
            return [], []
        keys = block_hashes(token_ids, items, cache_salt, self.prefix_cache.block_size)
        usable = (len(token_ids) - 1) // self.prefix_cache.block_size  # keep one token to compute
        return keys, self.prefix_cache.lookup(keys[:usable])

    def _count(self, num_tokens: int, num_cached: int) -> None:
        self.num_prefills += 1
        self.num_prompt_tokens += num_tokens
        self.num_cached_tokens += num_cached
