"""Prefill's last decoder layer runs o_proj and the MLP only on the rows whose hidden state is read.

A prefill forward reads one final hidden state per chunk: its last row, for the next token's logits
(services/prefill/packing.py).  Every layer's K/V is needed for every row, and layer l+1's K/V needs
layer l's whole output, so all layers but the last run in full, and the last layer's attention too (it
writes the K/V of every row).  Nothing reads the last layer's output beyond the chosen rows, so its
o_proj and its MLP run on those rows only; the other rows of its output are left without them (the
residual stream alone), and are never read.  On the medium demo (8 layers) that is an eighth of the
MLP and o_proj work of a prompt.

`install(lm)` wraps the two modules once (a `RowSubset` each, passing every row through unless rows
are set); `only_rows(wrappers, rows)` sets the rows around one forward.  The decode role never installs
them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class RowSubset(nn.Module):
    """`inner` on the rows `rows` of dim -2 (zeros elsewhere) while `rows` is set; else `inner` itself."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.rows: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if rows is None:
            return self.inner(x)
        picked = self.inner(x.index_select(-2, rows))
        out = picked.new_zeros(*x.shape[:-1], picked.shape[-1])
        return out.index_copy_(-2, rows, picked)


def install(lm: Any) -> list[RowSubset]:
    """Wrap the last decoder layer's o_proj and MLP (once; a second call returns the same wrappers)."""
    layer = lm.model.layers[-1]
    wrappers = []
    for parent, name in ((layer.self_attn, "o_proj"), (layer, "mlp")):
        module = getattr(parent, name)
        if not isinstance(module, RowSubset):
            module = RowSubset(module)
            setattr(parent, name, module)
        wrappers.append(module)
    return wrappers


@contextmanager
def only_rows(wrappers: list[RowSubset], rows: torch.Tensor) -> Iterator[None]:
    for wrapper in wrappers:
        wrapper.rows = rows
    try:
        yield
    finally:
        for wrapper in wrappers:
            wrapper.rows = None
