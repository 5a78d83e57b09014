"""Wire tensors in the tests: bfloat16 widened to float32 to compare values, and torch tensors as wire tensors."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.protocol.tensors import RawTensor, Tensor, to_numpy, wire_dtype


def bfloat16_to_float32(tensor: RawTensor) -> np.ndarray:
    """Exact widening of a bfloat16 RawTensor to float32 (bf16 is the top half of an fp32)."""
    if tensor.dtype != "bfloat16":
        raise ValueError(f"expected a bfloat16 tensor, got {tensor.dtype}")
    bits = to_numpy(tensor).astype(np.uint32) << 16
    return bits.view(np.float32)


def from_torch(tensor: Any) -> Tensor:
    """A torch tensor (any device) as a wire tensor; copies to CPU."""
    import torch

    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.dtype == torch.bfloat16:
        data = cpu.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
        return RawTensor("bfloat16", tuple(cpu.shape), data)
    array = cpu.numpy()
    wire_dtype(array)
    return array
