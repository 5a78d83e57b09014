"""Processor arrays -> PROTOCOL.md items, and items -> the wire `MultiModalFeatures`.

One `RenderedItem` per image or video: its mm_hash, its placeholder (the pad run),
`kwargs_item` (full processor output, what encode needs) and `metadata_item`
(only the light keys prefill still needs).  Field settings follow vLLM's
Qwen2-VL field config: pixel_values is "flat" (`flat_from_sizes` over the patch
counts), image_grid_thw is "batched" and kept on CPU (videos alike: pixel_values_videos flat,
video_grid_thw, second_per_grid_ts and timestamps batched on the CPU).  Keys keep the processor's
order (Qwen-VL: image_grid_thw, then pixel_values, as vLLM writes them).  As in vLLM, Qwen2.5-VL's
second_per_grid_ts is a scalar tensor in the model dtype and Qwen3-VL's timestamps a plain list of
floats.

On the wire each item's flat field carries, as vLLM's does, the slices of *all*
the request's items of its modality (`[[[0, 308, None]], [[308, 408, None]]]` in
both items of a two-image request), while its data is only its own rows.  The
slices depend on the other items, so they are filled in by `to_features` for the
request at hand; a stored RenderedItem keeps its own rows only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.protocol.features import MultiModalFeatures, PlaceholderRange
from services.protocol.items import FieldElem, FieldSpec, Item, Nested, flat_slices, metadata_only
from services.protocol.serialization import item_to_b64
from services.protocol.tensors import RawTensor

# Keys whose rows are patches: flattened across the items of a batch (vLLM flat_from_sizes).
_FLAT_KEYS = frozenset({"pixel_values", "pixel_values_videos"})
# Small per-item keys the model reads on the host (vLLM keep_on_cpu=True).
_CPU_KEYS = frozenset({"image_grid_thw", "video_grid_thw", "second_per_grid_ts", "timestamps", "image_sizes"})
_LIST_KEYS = frozenset({"timestamps"})            # plain lists of floats on the wire, as vLLM sends them
_MODEL_DTYPE_KEYS = frozenset({"second_per_grid_ts"})  # floats vLLM casts to the model dtype


@dataclass(frozen=True)
class RenderedItem:
    modality: str
    mm_hash: str
    offset: int
    length: int
    kwargs_item: Item
    metadata_item: Item


def field_for(key: str, array: np.ndarray) -> FieldSpec:
    """The field settings of one processor key for a single item."""
    if key in _FLAT_KEYS:
        return FieldSpec.flat(flat_slices([int(array.shape[0])]), dim=0)
    return FieldSpec.batched(keep_on_cpu=key in _CPU_KEYS)


def _wire(key: str, array: np.ndarray, dtype: str) -> Nested:
    if key in _LIST_KEYS:
        return [float(v) for v in array.reshape(-1)]
    if key in _MODEL_DTYPE_KEYS and dtype == "bfloat16":
        return to_bfloat16(array)
    return _contiguous(array, np.dtype(dtype) if key in _MODEL_DTYPE_KEYS else array.dtype)


def _contiguous(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """C-contiguous in `dtype`, keeping a scalar's shape () (np.ascontiguousarray makes it (1,))."""
    if array.flags.c_contiguous and array.dtype == dtype:
        return array
    return np.array(array, dtype=dtype, order="C")


def to_bfloat16(array: np.ndarray) -> RawTensor:
    """float32 -> bfloat16 rounded to nearest even, as torch's `.to(torch.bfloat16)`."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return RawTensor("bfloat16", tuple(array.shape), rounded.tobytes())


def build_item(arrays: Mapping[str, np.ndarray], dtype: str = "float32") -> Item:
    """Per-item processor arrays (processor key order) as a protocol item; `dtype`: the model's."""
    return {key: FieldElem(_wire(key, array, dtype), field_for(key, array)) for key, array in arrays.items()}


def rendered_item(modality: str, mm_hash: str, offset: int, length: int,
                  arrays: Mapping[str, np.ndarray], metadata_keys: Sequence[str],
                  dtype: str = "float32") -> RenderedItem:
    kwargs_item = build_item(arrays, dtype)
    metadata_item = metadata_only(kwargs_item, metadata_keys)
    return RenderedItem(modality, mm_hash, offset, length, kwargs_item, metadata_item)


def to_features(items: Sequence[RenderedItem], *, include_kwargs: bool = True,
                include_metadata: bool = True) -> MultiModalFeatures | None:
    """The wire features (base64 items, grouped by modality in prompt order); None without items."""
    if not items:
        return None
    hashes: dict[str, list[str]] = {}
    placeholders: dict[str, list[PlaceholderRange]] = {}
    kwargs: dict[str, list[str | None]] = {}
    metadata: dict[str, list[str | None]] = {}
    ordered = sorted(items, key=lambda it: it.offset)
    request_items = with_request_slices(ordered) if include_kwargs else [it.kwargs_item for it in ordered]
    for item, kwargs_item in zip(ordered, request_items, strict=True):
        modality = item.modality
        hashes.setdefault(modality, []).append(item.mm_hash)
        placeholders.setdefault(modality, []).append(PlaceholderRange(offset=item.offset, length=item.length))
        kwargs.setdefault(modality, []).append(item_to_b64(kwargs_item) if include_kwargs else None)
        light = item_to_b64(item.metadata_item) if include_metadata else None
        metadata.setdefault(modality, []).append(light)
    return MultiModalFeatures(mm_hashes=hashes, mm_placeholders=placeholders,
                              kwargs_data=kwargs if include_kwargs else None,
                              mm_metadata=metadata if include_metadata else None)


def with_request_slices(items: Sequence[RenderedItem]) -> list[Item]:
    """Each item's kwargs with its flat fields' slices set to vLLM's: every item of the modality, in order."""
    sizes: dict[tuple[str, str], list[int]] = {}
    for item in items:
        for key, elem in item.kwargs_item.items():
            if elem.field.kind == "flat" and isinstance(elem.data, np.ndarray):
                sizes.setdefault((item.modality, key), []).append(int(elem.data.shape[elem.field.dim]))
    out: list[Item] = []
    for item in items:
        out.append({key: _request_elem(elem, sizes.get((item.modality, key))) for key, elem in
                    item.kwargs_item.items()})
    return out


def _request_elem(elem: FieldElem, sizes: list[int] | None) -> FieldElem:
    if sizes is None:
        return elem
    field = FieldSpec.flat(flat_slices(sizes, elem.field.dim), dim=elem.field.dim,
                           keep_on_cpu=elem.field.keep_on_cpu)
    return FieldElem(elem.data, field)
