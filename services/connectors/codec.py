"""Payload layout shared by the backends: tensors laid out back to back at aligned offsets.

A payload is the raw bytes of each tensor, each starting at a multiple of
ALIGN so a consumer can view any dtype in place.  A `TensorSpec` describes one
tensor inside it and travels in handles and headers as a plain dict.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.connectors.base import EntryCorrupt

ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}") from None


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
        if self.dtype not in DTYPES:
            raise EntryCorrupt(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        numel = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        itemsize = DTYPES[self.dtype].itemsize
        if min(self.shape, default=0) < 0 or numel * itemsize != self.nbytes:
            raise EntryCorrupt(f"tensor {self.name!r}: shape {self.shape} of {self.dtype} is not "
                               f"{self.nbytes} bytes")
        if self.offset < 0 or self.offset % ALIGN:
            raise EntryCorrupt(f"tensor {self.name!r}: bad offset {self.offset}")


def specs_from(items: Any) -> list[TensorSpec]:
    if not isinstance(items, list):
        raise EntryCorrupt(f"tensor list expected, got {type(items).__name__}")
    return [TensorSpec.from_dict(d) for d in items]


def plan(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Specs of `tensors` laid out back to back, and the payload length."""
    specs, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset = align_up(offset + nbytes)
    return specs, offset


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat uint8 array (copies only if it is not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)


def tensor_at(buf: np.ndarray, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """A tensor viewing spec's bytes inside `buf` (a uint8 array); no copy."""
    raw = buf[base + spec.offset: base + spec.offset + spec.nbytes]
    return torch.from_numpy(raw).view(DTYPES[spec.dtype]).view(spec.shape)


def crc_of(chunks: Iterable[np.ndarray]) -> int:
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk.data, crc)
    return crc
