"""Prefill's KV memory: one preallocated pool of fixed-size token blocks.

The pool is a single tensor [num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim]
(0 = keys, 1 = values) in the model dtype.  A prompt's KV lives in the blocks its block list
names; token i of the prompt sits in pool row `blocks[i // block_size] * block_size +
i % block_size` (its *slot*).  Everything moves by slot index, in one tensor op each:

- `write`: a forward's new keys/values (all prompts of a packed batch at once) into their slots;
- `gather`: a prompt's past keys/values for attention (one copy, only when a chunk has a past:
  earlier chunks or prefix-cache hits);
- `copy_out`: a finished prompt's whole KV into the wire layout [num_layers, 2, num_kv_heads,
  L, head_dim] (the hand-off's one copy, straight into the KV store's memory: a pool segment's view,
  a CUDA tensor the store hands over by IPC handle, or from a CUDA pool a gathered copy into a host
  buffer, the Redis path).

Who owns which block is `BlockManager`'s business (blocks.py); the pool only holds bytes.
The tensor is made with `torch.empty`, so untouched blocks cost no resident memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.models.base import KVLayout

if TYPE_CHECKING:
    import torch


def block_bytes(layout: KVLayout, block_size: int) -> int:
    """Bytes one block holds across all layers (keys and values)."""
    import torch

    element = torch.empty((), dtype=layout.dtype).element_size()
    return layout.num_layers * 2 * layout.num_kv_heads * block_size * layout.head_dim * element


class KVPool:
    """Token blocks of KV for every layer, addressed by slot index tensors."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: Any = "cpu") -> None:
        import torch

        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        shape = (layout.num_layers, 2, layout.num_kv_heads, num_blocks * block_size, layout.head_dim)
        self.data = torch.empty(shape, dtype=layout.dtype, device=device)
        self._offsets = torch.arange(block_size, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Pool rows of prompt tokens [start, end) for a prompt holding `blocks` (int64, on the pool's device)."""
        import torch

        first, last = start // self.block_size, (end - 1) // self.block_size + 1
        ids = torch.tensor(blocks[first:last], dtype=torch.long, device=self.data.device)
        rows = (ids[:, None] * self.block_size + self._offsets).reshape(-1)
        skip = start - first * self.block_size
        return rows[skip:skip + end - start]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [num_kv_heads, n, head_dim] into `slots` (n of them) of `layer`."""
        self.data[layer, 0].index_copy_(1, slots, keys)
        self.data[layer, 1].index_copy_(1, slots, values)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[2, num_kv_heads, n, head_dim]: keys and values of `slots` of `layer` (a copy)."""
        return self.data[layer].index_select(2, slots)

    def copy_out(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """The KV of `slots` into `out` [num_layers, 2, num_kv_heads, len(slots), head_dim]: one copy."""
        import torch

        expected = (*self.data.shape[:3], slots.numel(), self.data.shape[4])
        if tuple(out.shape) != expected or out.dtype != self.data.dtype:
            raise ValueError(f"KV destination must be {expected} {self.data.dtype}, got {tuple(out.shape)} "
                             f"{out.dtype}")
        if out.device != self.data.device:   # a CUDA pool into a host buffer (Redis: device -> pinned host)
            out.copy_(self.data.index_select(3, slots))
        elif out.is_contiguous():
            torch.index_select(self.data, 3, slots, out=out)
        else:
            out.copy_(self.data.index_select(3, slots))
