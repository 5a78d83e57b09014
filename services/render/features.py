"""Processor arrays -> PROTOCOL.md items, and items -> the wire `MultiModalFeatures`.

One `RenderedItem` per image: its mm_hash, its placeholder (the pad run),
`kwargs_item` (full processor output, what encode needs) and `metadata_item`
(only the light keys prefill still needs).  Field settings follow vLLM's
Qwen2-VL field config: pixel_values is "flat" (sliced by patch count, so one
item's rows are [0, n_patches)), image_grid_thw is "batched" and kept on CPU.
Keys keep the processor's order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.protocol.features import MultiModalFeatures, PlaceholderRange
from services.protocol.items import FieldElem, FieldSpec, Item, metadata_only
from services.protocol.serialization import item_to_b64

IMAGE = "image"
# Keys prefill needs for M-RoPE positions (the Qwen-VL adapter's metadata_keys).
QWEN_VL_METADATA_KEYS: tuple[str, ...] = ("image_grid_thw",)
# Keys whose rows are patches: flattened across the items of a batch (vLLM flat_from_sizes).
_FLAT_KEYS = frozenset({"pixel_values", "pixel_values_videos"})
# Small per-item keys the model reads on the host (vLLM keep_on_cpu=True).
_CPU_KEYS = frozenset({"image_grid_thw", "video_grid_thw", "second_per_grid_ts", "image_sizes"})


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
        return FieldSpec.flat([(0, int(array.shape[0]), None)], dim=0)
    return FieldSpec.batched(keep_on_cpu=key in _CPU_KEYS)


def build_item(arrays: Mapping[str, np.ndarray]) -> Item:
    """Per-item processor arrays (processor key order) as a protocol item."""
    return {key: FieldElem(np.ascontiguousarray(array), field_for(key, array))
            for key, array in arrays.items()}


def rendered_item(modality: str, mm_hash: str, offset: int, length: int,
                  arrays: Mapping[str, np.ndarray], metadata_keys: Sequence[str]) -> RenderedItem:
    kwargs_item = build_item(arrays)
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
    for item in sorted(items, key=lambda it: it.offset):
        modality = item.modality
        hashes.setdefault(modality, []).append(item.mm_hash)
        placeholders.setdefault(modality, []).append(PlaceholderRange(offset=item.offset, length=item.length))
        kwargs.setdefault(modality, []).append(item_to_b64(item.kwargs_item) if include_kwargs else None)
        light = item_to_b64(item.metadata_item) if include_metadata else None
        metadata.setdefault(modality, []).append(light)
    return MultiModalFeatures(mm_hashes=hashes, mm_placeholders=placeholders,
                              kwargs_data=kwargs if include_kwargs else None,
                              mm_metadata=metadata if include_metadata else None)
