"""The multimodal item data model (one processor output per image/video/audio).

An item maps each processor key ("pixel_values", "image_grid_thw", ...) to a
`FieldElem`: the data plus the `FieldSpec` saying how the key batches
(vLLM's batched / flat / shared field factories).  Insertion order is the
processor's key order and is kept on the wire.  `serialization.py` turns items
into bytes; the helpers here are what the roles do with items: keep only the
light metadata keys for prefill, merge kwargs with metadata, size a payload.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import numpy as np

from services.protocol.tensors import RawTensor, tensor_nbytes

if TYPE_CHECKING:
    import torch

FieldKind = Literal["batched", "flat", "shared"]
FIELD_KINDS: tuple[str, ...] = ("batched", "flat", "shared")
Slice: TypeAlias = tuple[int | None, int | None, int | None]
# One item's place in a flat field: a slice along `dim`, or (vLLM's form) one slice per dimension.
SliceEntry: TypeAlias = "Slice | tuple[Slice, ...]"
# a torch tensor: a zero-copy view of a connector store (services/connectors/mm.py open_item), never on the wire
Nested: TypeAlias = "np.ndarray | RawTensor | torch.Tensor | int | float | list[Nested]"


def _is_bound(value: object) -> bool:
    return value is None or type(value) is int


def _as_slice(value: Sequence[int | None] | slice) -> Slice:
    parts = (value.start, value.stop, value.step) if isinstance(value, slice) else tuple(value)
    if len(parts) == 2:
        parts = (*parts, None)
    if len(parts) != 3 or not all(_is_bound(p) for p in parts):
        raise ValueError(f"slice {list(parts)} must be [start, stop, step] with integers or null")
    return parts  # type: ignore[return-value]


def _as_entry(value: object) -> SliceEntry:
    """One item's slice: [start, stop, step] (dim 0), or one such slice per dimension (vLLM's nesting)."""
    if isinstance(value, slice):
        return _as_slice(value)
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"slice {value!r} must be [start, stop, step] or a list of them, one per dimension")
    if isinstance(value[0], list | tuple | slice):
        return tuple(_as_slice(part) for part in value)  # type: ignore[arg-type]
    return _as_slice(value)  # type: ignore[arg-type]


def flat_slices(sizes: Iterable[int], dim: int = 0) -> list[SliceEntry]:
    """vLLM's `flat_from_sizes` slices: per item, (slice(None),) * dim + (slice(start, stop),)."""
    entries: list[SliceEntry] = []
    start = 0
    for size in sizes:
        entries.append(((None, None, None),) * dim + ((start, start + size, None),))
        start += size
    return entries


def _wire_entry(entry: SliceEntry) -> list:
    if entry and isinstance(entry[0], tuple):
        return [list(part) for part in entry]  # type: ignore[union-attr]
    return list(entry)


@dataclass(frozen=True)
class FieldSpec:
    """How one key of an item batches: vLLM's field factory name and its settings."""

    kind: FieldKind
    keep_on_cpu: bool = False
    slices: list[SliceEntry] | None = None  # flat only: where each item sits in the flattened batch
    dim: int = 0  # flat only: the dimension that is flattened
    batch_size: int | None = None  # shared only

    def __post_init__(self) -> None:
        if self.kind not in FIELD_KINDS:
            raise ValueError(f"unknown field factory {self.kind!r} (supported: {', '.join(FIELD_KINDS)})")
        if self.kind == "flat":
            if self.slices is None:
                raise ValueError("a flat field needs slices")
            if not isinstance(self.slices, list | tuple):
                raise ValueError("flat slices must be a list with one entry per item")
            object.__setattr__(self, "slices", [_as_entry(s) for s in self.slices])
        elif self.slices is not None:
            raise ValueError(f"slices only apply to flat fields, not {self.kind}")
        if self.kind == "shared" and (type(self.batch_size) is not int or self.batch_size < 0):
            raise ValueError("a shared field needs a non-negative integer batch_size")

    @classmethod
    def batched(cls, keep_on_cpu: bool = False) -> FieldSpec:
        return cls("batched", keep_on_cpu)

    @classmethod
    def flat(cls, slices: Iterable[object], dim: int = 0,
             keep_on_cpu: bool = False) -> FieldSpec:
        return cls("flat", keep_on_cpu, slices=list(slices), dim=dim)  # type: ignore[arg-type]

    @classmethod
    def shared(cls, batch_size: int, keep_on_cpu: bool = False) -> FieldSpec:
        return cls("shared", keep_on_cpu, batch_size=batch_size)

    def factory_kw(self) -> dict[str, object]:
        """The factory settings in wire order (PROTOCOL.md)."""
        if self.kind == "batched":
            return {"keep_on_cpu": self.keep_on_cpu}
        if self.kind == "flat":
            return {"keep_on_cpu": self.keep_on_cpu, "slices": [_wire_entry(s) for s in self.slices or []],
                    "dim": self.dim}
        return {"keep_on_cpu": self.keep_on_cpu, "batch_size": self.batch_size}


@dataclass(frozen=True)
class FieldElem:
    """One key of an item: its data (None = absent) and how it batches."""

    data: Nested | None
    field: FieldSpec


Item: TypeAlias = dict[str, FieldElem]


def metadata_only(item: Mapping[str, FieldElem], keys: Iterable[str]) -> Item:
    """The item restricted to `keys` (e.g. image_grid_thw for Qwen-VL), in the item's order."""
    wanted = set(keys)
    return {key: elem for key, elem in item.items() if key in wanted}


def nested_nbytes(data: Nested | None) -> int:
    """Bytes of tensor data in a nested value; a scalar counts 8 (its msgpack width)."""
    if data is None:
        return 0
    if isinstance(data, np.ndarray | RawTensor):
        return tensor_nbytes(data)
    if isinstance(data, list | tuple):
        return sum(nested_nbytes(d) for d in data)
    return 8


def item_payload_nbytes(item: Mapping[str, FieldElem]) -> int:
    """Total payload bytes of an item (tensor bytes; what a transfer or cache entry costs)."""
    return sum(nested_nbytes(elem.data) for elem in item.values())
