"""Linear layers for small batches (decode steps): a C kernel over weights laid out in panels.

A decode step multiplies a handful of rows by every weight of the model once, so its matmuls are
bound by how fast the weights stream from memory.  `PanelLinear` keeps the weight in panels of 16
output rows interleaved by input column (`panelize`: [ceil(N/16), K, 16], zero rows past N), and
services/kernels/panel.c reads each panel once per tile of up to 6 rows with AVX2 FMAs.
On this project's 2-core machine it runs SmolLM2's linears (538 MB of fp32 weights) 1.9x faster
than oneDNN's prepacked GEMM at 1 row and 1.3x at 16, reading the weights at ~90% of the rate of a
plain sum over them (benchmarks/linear_kernels.py; docs/benchmarks.md).

Who uses it: `prepack.prepack_language(lm, "panel")`, or "auto" when its start-up timing on the
model's own weights finds it fastest (services/models/prepack.py).  The kernel is built at install
(services/kernels/panel.c: AVX2 and AVX-512 variants, chosen by the CPU at run time); `available()` says
whether one runs here, and "auto" skips it otherwise.  Any M works (tiles of 6 rows); large M (prefill)
is oneDNN's ground.
Outputs agree with F.linear to ~1e-6 relative (one in-order float32 sum per output).

`PanelLinear(linear, torch.bfloat16)` keeps the panels in bfloat16 (the kernel built with
-DEPD_PANEL_BF16, "panel_bf16", widens them in registers; the arithmetic stays float32): half the bytes per step,
for decode's `--dtype bfloat16` (services/decode/app.py).  Its outputs are F.linear's over the
weights rounded to bfloat16, to ~1e-6 relative.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from services import kernels
from services.models.swapped import SwappedLinear

NR = 16                          # output rows per panel (two AVX2 vectors)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
LIBRARIES = {torch.float32: "panel", torch.bfloat16: "panel_bf16"}   # services/kernels/spec.py


def _kernel(weight_dtype: torch.dtype = torch.float32) -> Any:
    """The panel library for float32 or bfloat16 panels (services/kernels/panel.c's two builds), or None."""
    try:
        lib = kernels.library(LIBRARIES[weight_dtype])
    except OSError:
        return None
    fn = lib.epd_panel_linear
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [ptr, i64, i32, ptr, i32, i32, ptr, ptr, i64, i32]
    fn.restype = i32
    return lib


def available(weight_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel (for float32 or bfloat16 panels) runs here (built at install, AVX2 and FMA)."""
    return weight_dtype in WEIGHT_DTYPES and _kernel(weight_dtype) is not None


def unavailable_reason(weight_dtype: torch.dtype = torch.float32) -> str:
    loaded = kernels.load(LIBRARIES[weight_dtype])
    return "" if loaded.ok else f"{loaded.variant} ({loaded.reason})"


def panelize(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16]: panel q holds rows 16q..16q+15, interleaved by column."""
    out_features, in_features = weight.shape
    padded = -(-out_features // NR) * NR
    panels = torch.zeros(padded // NR, in_features, NR, dtype=weight.dtype)
    panels[: out_features // NR] = weight[: out_features // NR * NR].view(-1, NR, in_features).transpose(1, 2)
    tail = out_features % NR
    if tail:
        panels[-1, :, :tail] = weight[out_features - tail:].t()
    return panels


class PanelLinear(SwappedLinear):
    """`nn.Linear` whose weight lives in panels (the original tensor is dropped)."""

    kernel = "panel"

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(linear.in_features, linear.out_features)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"panel weights are float32 or bfloat16, not {weight_dtype}")
        self._attach(panelize(linear.weight.detach().to(weight_dtype)),
                     None if linear.bias is None else linear.bias.detach().contiguous())

    @classmethod
    def from_panels(cls, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> PanelLinear:
        """A layer over panels already laid out as `panelize` lays them ([ceil(N/16), K, 16], float32 or
        bfloat16; taken as they are when contiguous, not copied)."""
        if panels.dim() != 3 or panels.shape[2] != NR or panels.shape[0] != -(-out_features // NR):
            raise ValueError(f"panels {tuple(panels.shape)} do not hold {out_features} outputs")
        if panels.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"panel weights are float32 or bfloat16, not {panels.dtype}")
        layer = cls.__new__(cls)
        SwappedLinear.__init__(layer, panels.shape[1], out_features)
        layer._attach(panels.contiguous(), bias)
        return layer

    def _attach(self, panels: torch.Tensor, bias: torch.Tensor | None) -> None:
        lib = _kernel(panels.dtype)
        if lib is None:
            raise OSError(f"panel linear kernel unavailable: {unavailable_reason(panels.dtype)}")
        self._fn = lib.epd_panel_linear
        self.weight = panels
        if self.weight.data_ptr() % 32:
            raise ValueError("panel weights must be 32-byte aligned")
        self.bias = bias

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"PanelLinear takes float32 CPU input, got {x.dtype} on {x.device}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1 or rows.stride(0) < self.in_features:
            rows = rows.contiguous()
        count = rows.shape[0]
        out = torch.empty(count, self.out_features, dtype=x.dtype)
        if count:
            bias = self.bias.data_ptr() if self.bias is not None else None
            status = self._fn(rows.data_ptr(), rows.stride(0), count, self.weight.data_ptr(), self.out_features,
                              self.in_features, bias, out.data_ptr(), self.out_features, torch.get_num_threads())
            if status:
                raise ValueError(f"panel linear refused x {tuple(x.shape)} for {self.out_features}x{self.in_features}")
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, panels={NR}"
                f"{', bfloat16' if self.weight.dtype == torch.bfloat16 else ''}")
