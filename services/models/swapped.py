"""The common shape of a swapped linear layer.

`SwappedLinear` is an `nn.Linear` stand-in whose weight lives in a kernel's own layout:
prepack.PackedLinear (oneDNN's blocked layout) and panel_linear.PanelLinear (16-row panels for
the C kernel).  Subclasses implement `run(x)`.  transformers reads `layer.weight.dtype` and
`.device` of some layers; the swapped weight keeps both (its shape is the kernel's).
"""

from __future__ import annotations

import torch
from torch import nn


class SwappedLinear(nn.Module):
    kernel = ""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
