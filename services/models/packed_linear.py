"""The oneDNN-packed linear and what every kernel swap is measured with: `PackedLinear` (a plain `nn.Linear` over a
oneDNN-packed weight), the tolerance a swapped kernel must meet against F.linear, and the interleaved timing that
compares candidates.  services/models/prepack.py decides the swaps; services/models/fused_mlp.py builds on these."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from services.models.swapped import SwappedLinear

MIN_SPEEDUP = 1.05            # below this the swap is not worth a second code path
MAX_REL_DIFF = 1e-4           # swapped outputs must agree with F.linear this closely (float32)
MAX_REL_DIFF_BF16 = 1e-2      # bfloat16 outputs carry 8 bits: one rounding step is 2^-8 of the element
_BATCH_HINT = 16              # oneDNN picks its blocking for this many rows (decode batches)
_ROUNDS = 3


class PackedLinear(SwappedLinear):
    """`nn.Linear` over a oneDNN-packed weight.  `weight` is the opaque packed tensor: its dtype,
    device and shape read as the original's (transformers reads `fc2.weight.dtype`), its values
    only through `forward`."""

    kernel = "prepacked"

    def __init__(self, linear: nn.Linear, batch_hint: int = _BATCH_HINT, weight_dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__(linear.in_features, linear.out_features)
        weight = linear.weight.detach()
        # weights kept in another dtype than the model's (decode's bfloat16 weights over float32
        # activations): the input is cast to it and the output back
        self.cast = weight_dtype if weight_dtype not in (None, weight.dtype) else None
        self.weight = pack_weight(weight.to(self.cast) if self.cast else weight, batch_hint)
        bias = None if linear.bias is None else linear.bias.detach()
        self.bias = bias.to(self.cast) if bias is not None and self.cast else bias

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast is not None:
            out = torch.ops.mkldnn._linear_pointwise(x.to(self.cast).contiguous(), self.weight, self.bias, "none",
                                                     [], "")
            return out.to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_weight(weight: torch.Tensor, batch_hint: int = _BATCH_HINT) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def can_pack(linear: nn.Module | None) -> bool:
    """A plain CPU `nn.Linear` oneDNN can pack: float32, or bfloat16 where this CPU has bf16 arithmetic."""
    weight = getattr(linear, "weight", None)
    return (type(linear) is nn.Linear and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_packable())))


def bf16_packable() -> bool:
    """oneDNN packs and multiplies bfloat16 here (AVX512-BF16 / AMX, or avx512bw+vl+dq)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def tolerance(dtype: torch.dtype) -> float:
    """How closely a swapped kernel's outputs must agree with F.linear's, relative to the largest."""
    return MAX_REL_DIFF_BF16 if dtype == torch.bfloat16 else MAX_REL_DIFF


def _geomean(values: list[float]) -> float:
    """Each batch size a role sees counts the same: a one-row decode step's speed-up is not drowned by
    the larger time of a sixteen-row one."""
    return math.prod(values) ** (1 / len(values))


def _compare(candidates: dict[str, list[nn.Module]], x: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
    """Best time of one call per kernel (each call a different layer of the shape, in turn), and each
    kernel's largest relative difference from F.linear over those layers."""
    diffs = dict.fromkeys((k for k in candidates if k != "default"), 0.0)
    for index, reference_layer in enumerate(candidates["default"]):
        reference = reference_layer(x)
        scale = reference.abs().max().clamp_min(1e-30)
        for kernel in diffs:
            diffs[kernel] = max(diffs[kernel], float((reference - candidates[kernel][index](x)).abs().max() / scale))
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(_ROUNDS):   # interleaved: machine noise falls on all of them
        for key, layers in candidates.items():
            for layer in layers:
                start = time.perf_counter()
                layer(x)
                best[key] = min(best[key], (time.perf_counter() - start) * 1e3)
    return best, diffs
