"""Payload layout shared by the backends: tensors laid out back to back at aligned offsets.

A payload is the raw bytes of each tensor, each starting at a multiple of
ALIGN so a consumer can view any dtype in place.  A `TensorSpec` describes one
tensor inside it and travels in handles and headers as a plain dict.

Writers may hand torch tensors or numpy arrays (torch-free producers: render
and the coordinator write multimodal inputs as numpy); torch is imported only
where a torch tensor is made or read (`tensor_at`, `torch_dtype`), so a
process that never reads tensors never imports it.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np
from typing_extensions import TypeIs

from services.connectors.base import EntryCorrupt

if TYPE_CHECKING:
    import torch

ALIGN = 64
# dtype name -> bytes per element (the names are torch's without "torch."; numpy's where it has them)
ITEMSIZE: dict[str, int] = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
                            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
Data = Union["torch.Tensor", np.ndarray]


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)  # ITEMSIZE's names are torch attribute names


def dtype_name(dtype: Any) -> str:
    """The wire name of a torch or numpy dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(ITEMSIZE)}")
    return name


def is_array(t: Any) -> TypeIs[np.ndarray]:
    return isinstance(t, np.ndarray)


def key_hash(key: str) -> int:
    """64-bit digest of a key, stored in headers to catch a handle pointing at another key's entry."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: Any) -> TensorSpec:
        try:
            spec = cls(str(d["name"]), str(d["dtype"]), tuple(int(n) for n in d["shape"]),
                       int(d["offset"]), int(d["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EntryCorrupt(f"malformed tensor spec {d!r}: {exc}") from None
        spec.check()
        return spec

    def check(self) -> None:
        """The spec is self-consistent: known dtype, nbytes = numel * itemsize, aligned offset."""
        if self.dtype not in ITEMSIZE:
            raise EntryCorrupt(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        numel = math.prod(self.shape)   # exact (Python ints); a C loop, not np.prod's Python wrapper
        itemsize = ITEMSIZE[self.dtype]
        if min(self.shape, default=0) < 0 or numel * itemsize != self.nbytes:
            raise EntryCorrupt(f"tensor {self.name!r}: shape {self.shape} of {self.dtype} is not "
                               f"{self.nbytes} bytes")
        if self.offset < 0 or self.offset % ALIGN:
            raise EntryCorrupt(f"tensor {self.name!r}: bad offset {self.offset}")


def specs_from(items: Any) -> list[TensorSpec]:
    if not isinstance(items, list):
        raise EntryCorrupt(f"tensor list expected, got {type(items).__name__}")
    return [TensorSpec.from_dict(d) for d in items]


def plan(tensors: dict[str, Data]) -> tuple[list[TensorSpec], int]:
    """Specs of `tensors` (torch tensors or numpy arrays) laid out back to back, and the payload length."""
    return plan_specs({name: (_dtype_of(name, t), tuple(t.shape)) for name, t in tensors.items()})


def plan_specs(specs: dict[str, tuple[Any, ...]]) -> tuple[list[TensorSpec], int]:
    """Specs for (dtype, shape[, device]) laid out back to back, and the payload length."""
    out, offset = [], 0
    for name, (dtype, shape, *_) in specs.items():
        wire = dtype_name(dtype)
        shape = tuple(int(n) for n in shape)
        nbytes = math.prod(shape) * ITEMSIZE[wire]
        out.append(TensorSpec(name, wire, shape, offset, nbytes))
        offset = align_up(offset + nbytes)
    return out, offset


def _dtype_of(name: str, t: Any) -> Any:
    if not hasattr(t, "dtype") or not hasattr(t, "shape") or isinstance(t, np.generic):
        raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor or numpy array")
    return t.dtype


def byte_view(t: Data) -> np.ndarray:
    """The bytes of a CPU tensor or array as a flat uint8 array (copies only if it is not contiguous)."""
    if is_array(t):
        flat = np.ascontiguousarray(t).reshape(-1)
        return flat.view(np.uint8) if flat.size else np.empty(0, np.uint8)
    flat_t = t.detach().contiguous().reshape(-1)
    import torch

    return flat_t.view(torch.uint8).numpy() if flat_t.numel() else np.empty(0, np.uint8)


def bytes_at(buf: np.ndarray, spec: TensorSpec, base: int = 0) -> np.ndarray:
    """spec's bytes inside `buf` (a uint8 array) as a uint8 slice; no copy."""
    return buf[base + spec.offset: base + spec.offset + spec.nbytes]


def copy_into(buf: np.ndarray, spec: TensorSpec, base: int, t: Data) -> int:
    """Copy `t` into its place in `buf` (one copy); the bytes copied."""
    if is_array(t):
        np.copyto(bytes_at(buf, spec, base), byte_view(t))
    else:
        tensor_at(buf, spec, base).copy_(t.detach())
    return spec.nbytes


def tensor_at(buf: np.ndarray, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """A tensor viewing spec's bytes inside `buf` (a uint8 array); no copy."""
    import torch

    return torch.from_numpy(bytes_at(buf, spec, base)).view(torch_dtype(spec.dtype)).view(spec.shape)


def crc_of(chunks: Iterable[np.ndarray]) -> int:
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk.data, crc)
    return crc
