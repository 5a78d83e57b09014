"""Multimodal inputs by handle: an item's processor tensors in the "mm" store, only a handle on the wire.

Render (and the coordinator, for a features request posted to it) writes each
item's tensors once: `store_item` puts every numpy-valued key of the item
(pixel_values, image_grid_thw, ...) into the mm store under
`mm_key(model, mm_hash)` and returns the item's *skeleton* (the same
PROTOCOL.md item with those keys' data nil: field settings and small values
only, a few hundred bytes) and an `MmRef` (the store handle and which keys it
holds).  Those two travel in the RenderResponse and the EncodeRequest
(`kwargs_data` = skeleton, `kwargs_ref_json` = ref), so no pixel byte crosses
the coordinator's gRPC.  Encode (and prefill when it must encode inline)
opens the item with `open_item`: zero-copy views of the stored tensors
merged into the skeleton, valid inside the block (a view whose entry was
evicted meanwhile raises EntryMissing when the block ends: nothing computed
from torn bytes is kept).

An entry already stored for the same key is reused (same content hash, same
tensors), so an image render has seen is not written again.  Producers hold
no torch: values are numpy arrays; readers get torch tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.connectors.base import ConnectorError, TensorStore
from services.protocol.errors import InvalidRequest
from services.protocol.items import FieldElem, Item


def mm_key(model_id: str, mm_hash: str) -> str:
    if not model_id or not mm_hash:
        raise ValueError("mm_key needs a model id and an mm_hash")
    return f"{model_id}|{mm_hash}"


@dataclass(frozen=True)
class MmRef:
    """Where an item's tensors are: the mm store handle and the item keys it holds."""

    handle: dict[str, Any]
    keys: tuple[str, ...]

    def to_json(self) -> bytes:
        return json.dumps({"handle": self.handle, "keys": list(self.keys)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str, where: str = "kwargs_ref") -> MmRef:
        try:
            body = json.loads(raw)
            handle, keys = body["handle"], body["keys"]
            if not isinstance(handle, dict) or not all(isinstance(k, str) for k in keys):
                raise TypeError("handle must be an object and keys strings")
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"{where}: not a multimodal input reference ({exc})",
                                 code="invalid_kwargs_ref") from None
        return cls(handle, tuple(keys))


def split_item(item: Item) -> tuple[Item, dict[str, np.ndarray]]:
    """(the skeleton: every array-valued key's data nil, the arrays by key)."""
    arrays = {key: elem.data for key, elem in item.items() if isinstance(elem.data, np.ndarray)}
    skeleton = {key: FieldElem(None, elem.field) if key in arrays else elem for key, elem in item.items()}
    return skeleton, arrays  # type: ignore[return-value]


def store_item(store: TensorStore, key: str, item: Item) -> tuple[Item, MmRef]:
    """Write the item's tensors once (or find them already stored); its skeleton and reference."""
    skeleton, arrays = split_item(item)
    handle = store.lookup(key)
    if handle is None or sorted(t["name"] for t in handle.get("tensors", [])) != sorted(arrays):
        handle = store.put(key, {k: np.ascontiguousarray(a) for k, a in arrays.items()})
    return skeleton, MmRef(handle, tuple(arrays))


@contextmanager
def open_item(store: TensorStore, skeleton: Item, ref: MmRef) -> Iterator[Item]:
    """The whole item: the skeleton with the stored keys' data as zero-copy views (torch) of the store."""
    missing = [k for k in ref.keys if k not in skeleton]
    if missing:
        raise InvalidRequest(f"kwargs_ref names keys the item lacks: {missing}", code="invalid_kwargs_ref")
    with store.view(ref.handle) as views:
        if set(views) != set(ref.keys):
            raise ConnectorError(f"mm entry holds {sorted(views)}, the reference names {sorted(ref.keys)}")
        yield {key: FieldElem(views[key], elem.field) if key in views else elem for key, elem in skeleton.items()}
