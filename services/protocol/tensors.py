"""Tensors on the wire without torch: numpy arrays, plus `RawTensor` for dtypes numpy lacks.

Render and the coordinator never import torch, yet they build and read the
msgpack items of PROTOCOL.md, so a tensor here is a numpy array, or a
`RawTensor` (dtype name, shape, raw little-endian bytes) for bfloat16.  Dtype
names are torch's without the "torch." prefix.  `to_torch` is for the roles
that do hold torch; it imports it only when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# numpy dtype (explicitly little-endian) per wire dtype name; None = numpy has no such dtype.
NUMPY_DTYPES: dict[str, str | None] = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": None,
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "?",
}
ITEM_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8,
    "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
MAX_NDIM = 32


def check_tensor_header(dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """Raise ValueError unless (dtype, shape) describes exactly `nbytes` bytes."""
    if dtype not in ITEM_SIZES:
        raise ValueError(f"unknown dtype {dtype!r} (supported: {', '.join(ITEM_SIZES)})")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensor has {len(shape)} dimensions, more than {MAX_NDIM}")
    if any(type(d) is not int or d < 0 for d in shape):
        raise ValueError(f"tensor shape {list(shape)} must hold non-negative integers")
    expected = prod(shape) * ITEM_SIZES[dtype]
    if expected != nbytes:
        raise ValueError(f"{dtype} tensor of shape {list(shape)} needs {expected} bytes, got {nbytes}")


@dataclass(frozen=True)
class RawTensor:
    """A C-contiguous little-endian tensor kept as bytes (used for bfloat16)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        check_tensor_header(self.dtype, self.shape, len(self.data))

    @property
    def nbytes(self) -> int:
        return len(self.data)


Tensor = np.ndarray | RawTensor


def wire_dtype(tensor: Tensor) -> str:
    """The wire dtype name of a tensor; ValueError for dtypes the protocol lacks."""
    name = tensor.dtype if isinstance(tensor, RawTensor) else tensor.dtype.name
    if name not in ITEM_SIZES:
        raise ValueError(f"dtype {name!r} cannot be serialized (supported: {', '.join(ITEM_SIZES)})")
    return name


def tensor_bytes(tensor: Tensor) -> bytes:
    """The C-contiguous little-endian bytes of a tensor."""
    if isinstance(tensor, RawTensor):
        return tensor.data
    little = NUMPY_DTYPES[wire_dtype(tensor)]
    if little is None:  # a numpy array can never carry a numpy-less dtype
        raise ValueError(f"dtype {tensor.dtype.name!r} needs a RawTensor")
    return np.asarray(tensor, dtype=little).tobytes(order="C")


def tensor_from_bytes(dtype: str, shape: tuple[int, ...], data: bytes) -> Tensor:
    """Zero-copy view of wire bytes: a read-only numpy array, or a RawTensor for bfloat16."""
    check_tensor_header(dtype, shape, len(data))
    little = NUMPY_DTYPES[dtype]
    if little is None:
        return RawTensor(dtype, shape, bytes(data))
    return np.frombuffer(data, dtype=little).reshape(shape)


def tensor_nbytes(tensor: Tensor) -> int:
    """Payload size in bytes."""
    return int(tensor.nbytes)


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A numpy view of a tensor; bfloat16 comes back as its uint16 bit pattern (numpy has no bfloat16)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    little = NUMPY_DTYPES[tensor.dtype] or "<u2"
    return np.frombuffer(tensor.data, dtype=little).reshape(tensor.shape)


def _has_float(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return any(_has_float(v) for v in value)
    return isinstance(value, float)


def to_torch(tensor: Tensor | torch.Tensor | Any) -> torch.Tensor:
    """A wire tensor as a CPU torch tensor that owns writable memory; a torch tensor (a zero-copy view
    from a connector store) passes through as it is; a plain number or list of numbers (Qwen3-VL's video
    timestamps) becomes a float64 or int64 tensor."""
    if not isinstance(tensor, np.ndarray | RawTensor) and hasattr(tensor, "data_ptr"):
        return tensor  # type: ignore[return-value]
    import torch

    if isinstance(tensor, list | tuple | int | float):
        return torch.tensor(tensor, dtype=torch.float64 if _has_float(tensor) else torch.int64)
    if isinstance(tensor, RawTensor) and tensor.dtype == "bfloat16":
        bits = np.frombuffer(bytearray(tensor.data), dtype="<i2").reshape(tensor.shape)
        return torch.from_numpy(bits).view(torch.bfloat16)
    array: Any = to_numpy(tensor)  # type: ignore[arg-type]   # the array forms; a torch tensor returned above
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)
