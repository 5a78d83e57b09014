"""mm_metadata as plain JSON number arrays (vLLM #56090's idea): readable by routers without msgpack or torch.

An entry of `features.mm_metadata` is either vLLM's base64 msgpack item or, in this form, a JSON
object mapping each key to its data as nested numbers, e.g. Qwen2-VL's `{"image_grid_thw": [1, 4, 4]}`
(one row [t, h, w] per image).  mm_metadata holds only placeholder-metadata fields, which vLLM keeps
on the CPU, so every key reads back as a `batched` field with `keep_on_cpu` (what render writes);
integers become int64 arrays, other numbers float32.  Generate accepts both forms in one request;
render answers in this form when the request asks `"mm_metadata_format": "json"` (an epd extension;
docs/protocol.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.protocol.items import FieldElem, FieldSpec, Item
from services.protocol.serialization import item_from_b64, item_to_b64
from services.protocol.tensors import RawTensor, to_numpy

MAX_JSON_VALUES = 4096  # numbers per key: metadata is a few integers per item, never pixels


def _array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, bool) or not isinstance(value, int | float | list):
        raise ValueError(f"{key}: must be a number or a (nested) array of numbers")
    try:
        array = np.asarray(value)
    except ValueError:
        raise ValueError(f"{key}: nested arrays must be rectangular") from None
    if array.dtype == object or array.dtype.kind not in "if" or array.size > MAX_JSON_VALUES:
        raise ValueError(f"{key}: must be a rectangular array of at most {MAX_JSON_VALUES} numbers "
                         "(no strings, booleans or nulls)")
    return np.ascontiguousarray(array, dtype=np.int64 if array.dtype.kind == "i" else np.float32)


def item_from_json(entry: dict[str, Any]) -> Item:
    """A JSON-array metadata entry as a protocol item (every key batched, kept on CPU)."""
    return {key: FieldElem(_array(key, value), FieldSpec.batched(keep_on_cpu=True))
            for key, value in entry.items()}


def json_to_b64(entry: dict[str, Any]) -> str:
    """The same entry as vLLM's base64 msgpack item (what the roles read)."""
    return item_to_b64(item_from_json(entry))


def _plain(data: Any) -> Any:
    if isinstance(data, np.ndarray | RawTensor):
        return to_numpy(data).tolist()
    if isinstance(data, list | tuple):
        return [_plain(d) for d in data]
    return data


def item_to_json(item: Item) -> dict[str, Any]:
    """A metadata item's data as plain JSON arrays, in the item's key order."""
    return {key: _plain(elem.data) for key, elem in item.items() if elem.data is not None}


def b64_to_json(entry: str) -> dict[str, Any]:
    return item_to_json(item_from_b64(entry))
