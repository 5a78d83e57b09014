"""A vision tower's patch embedding (a Conv3d whose kernel equals its stride) run as one matrix product.

Qwen-VL towers embed patches with `nn.Conv3d(C, D, kernel=(T, P, P), stride=(T, P, P))` over input
already cut into patches ([N, C, T, P, P]): each output is one dot product of a patch with each
filter, i.e. `patches.view(N, -1) @ weight.view(D, -1).T`.  oneDNN's convolution takes 13 ms for a
1024x768 image's 3,996 patches on this machine, the product 2 ms.  vLLM's `Conv3dLayer` makes the
same substitution.  The summation order differs from the convolution's (float32 results agree to
~1e-6 relative; the exactness suites still require Hugging Face's greedy tokens).  The product runs
in blocks of a fixed 256 rows (the last one zero-padded): a multi-threaded GEMM partitions its work by
its shape, so one product over all of a forward's rows would give an image different floats (~1e-6)
alone than batched with others; fixed-shape blocks give every patch the same floats in any batch, as
the convolution did.

`swap_patch_convs(module)` changes the class of every such Conv3d in place (weights, names and
state dict unchanged); an input of any other shape still runs the convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


ROWS = 256  # patches per product


class PatchConv3d(nn.Conv3d):
    """An nn.Conv3d with kernel == stride, no padding/dilation/groups: patch-shaped inputs as one GEMM."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or tuple(x.shape[1:]) != (self.in_channels, *self.kernel_size):
            return super().forward(x)
        rows, weight = x.reshape(x.shape[0], -1), self.weight.reshape(self.out_channels, -1)
        out = x.new_empty(x.shape[0], self.out_channels)
        for start in range(0, rows.shape[0], ROWS):  # every product ROWS x K: the same rows, the same floats
            part = rows[start:start + ROWS]
            if part.shape[0] < ROWS:
                part = torch.cat([part, part.new_zeros(ROWS - part.shape[0], part.shape[1])])
            out[start:start + ROWS] = F.linear(part, weight, self.bias)[:out.shape[0] - start]
        return out.view(x.shape[0], self.out_channels, 1, 1, 1)


def _is_patch_conv(module: nn.Module) -> bool:
    return (type(module) is nn.Conv3d and tuple(module.kernel_size) == tuple(module.stride)
            and all(p == 0 for p in module.padding) and all(d == 1 for d in module.dilation)  # type: ignore[union-attr]
            and module.groups == 1 and module.padding_mode == "zeros")


def swap_patch_convs(module: nn.Module) -> int:
    """Turn every patch-embedding Conv3d under `module` into a PatchConv3d; returns how many."""
    swapped = 0
    for child in module.modules():
        if _is_patch_conv(child):
            child.__class__ = PatchConv3d
            swapped += 1
    return swapped
