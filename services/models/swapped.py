"""The common shape of a swapped linear layer, and how a compiled graph calls one.

`SwappedLinear` is an `nn.Linear` stand-in whose weight lives in a kernel's own layout:
prepack.PackedLinear (oneDNN's blocked layout) and panel_linear.PanelLinear (16-row panels for
the C kernel).  Subclasses implement `run(x)`.  transformers reads `layer.weight.dtype` and
`.device` of some layers; the swapped weight keeps both (its shape is the kernel's).

torch.compile cannot trace an opaque oneDNN tensor or a ctypes call, so under compilation a
swapped layer calls the custom op `epd::packed_linear(x, index, out_features)` instead: `index` is
the layer's place in the list that the caller makes current with `packed_scope(linears)` around
each call of the compiled graph (so the graph names no object of this process and Inductor's
cache serves any load of the same model); the op's fake implementation gives the output shape,
and the compiled graph calls the same kernel between its fused kernels
(services/decode/compiled.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


class SwappedLinear(nn.Module):
    kernel = ""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scope_index: int | None = None   # its place in the list given to `packed_scope`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():   # the graph calls the kernel by index (module docstring)
            if self.scope_index is None:
                raise RuntimeError("a swapped linear is compiled without an index: number it with number_packed()")
            return torch.ops.epd.packed_linear(x, self.scope_index, self.out_features)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def number_packed(modules: Sequence[nn.Module]) -> list[SwappedLinear]:
    """The swapped linears among `modules` (in order), each told its index in the returned list."""
    packed = [m for m in modules if isinstance(m, SwappedLinear)]
    for index, module in enumerate(packed):
        module.scope_index = index
    return packed


_SCOPE = threading.local()


@contextmanager
def packed_scope(linears: list[SwappedLinear]) -> Iterator[None]:
    """Make `linears` the table `epd::packed_linear` indexes into, in this thread."""
    previous = getattr(_SCOPE, "linears", None)
    _SCOPE.linears = linears
    try:
        yield
    finally:
        _SCOPE.linears = previous


_OPS = torch.library.Library("epd", "FRAGMENT")
_OPS.define("packed_linear(Tensor x, int index, int out_features) -> Tensor")


def _packed_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    linears = getattr(_SCOPE, "linears", None)
    if linears is None:
        raise RuntimeError("epd::packed_linear called outside packed_scope()")
    return linears[index].run(x)


def _packed_linear_fake(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_OPS.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("epd::packed_linear", _packed_linear_fake, lib=_OPS)
