"""KV between a Hugging Face cache and the wire layout prefill hands to decode.

Wire layout: one tensor [num_layers, 2, num_kv_heads, L, head_dim] (0 = keys,
1 = values) for one request, in the model dtype.  A DynamicCache layer holds
[batch, num_kv_heads, L, head_dim]; only batch row 0 is used here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def new_cache() -> Any:
    """An empty DynamicCache (layers appear as the model writes them)."""
    from transformers import DynamicCache

    return DynamicCache()


def kv_from_cache(cache: Any, row: int = 0, start: int = 0) -> torch.Tensor:
    """Tokens [start:] of batch row `row` of a DynamicCache, as [num_layers, 2, kv_heads, L, head_dim]."""
    import torch

    return torch.stack([
        torch.stack([layer.keys[row, :, start:], layer.values[row, :, start:]]) for layer in cache.layers
    ])
