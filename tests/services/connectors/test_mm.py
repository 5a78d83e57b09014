"""Multimodal inputs by handle: an item's tensors stored once, read back as views merged into its skeleton."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.connectors import EntryMissing
from services.connectors.mm import MmRef, mm_key, open_item, split_item, store_item
from services.protocol.errors import InvalidRequest
from services.protocol.items import FieldElem, FieldSpec, item_payload_nbytes
from services.protocol.serialization import decode_item, encode_item

PIXELS = np.arange(16 * 1176, dtype=np.float32).reshape(16, 1176)
ITEM = {"pixel_values": FieldElem(PIXELS, FieldSpec.flat([(0, 16, None)])),
        "image_grid_thw": FieldElem(np.array([[1, 4, 4]], dtype=np.int64), FieldSpec.batched(keep_on_cpu=True)),
        "scale": FieldElem(2, FieldSpec.batched())}


@pytest.mark.parametrize("backend", ["shm", "redis"])
def test_stored_once_and_read_back_whole(make_store, backend):
    store = make_store(backend, purpose="mm")
    skeleton, ref = store_item(store, mm_key("m", "h1"), ITEM)
    wire = encode_item(skeleton)
    assert item_payload_nbytes(decode_item(wire)) == 8 and len(wire) < 300  # only the scalar travels inline
    assert ref.keys == ("pixel_values", "image_grid_thw")
    again_skeleton, again = store_item(store, mm_key("m", "h1"), ITEM)  # seen before: not written again
    assert again == ref and store.stats().puts == 1
    with open_item(store, decode_item(wire), MmRef.from_json(ref.to_json())) as full:
        assert list(full) == ["pixel_values", "image_grid_thw", "scale"]
        assert torch.equal(full["pixel_values"].data, torch.from_numpy(PIXELS))
        assert full["image_grid_thw"].data.tolist() == [[1, 4, 4]] and full["scale"].data == 2
        assert full["pixel_values"].field == ITEM["pixel_values"].field


def test_an_evicted_entry_is_entry_missing(make_store):
    store = make_store("shm", purpose="mm")
    skeleton, ref = store_item(store, mm_key("m", "h2"), ITEM)
    store.delete(mm_key("m", "h2"))
    with pytest.raises(EntryMissing):
        with open_item(store, skeleton, ref):
            pass


def test_a_bad_reference_is_a_400():
    with pytest.raises(InvalidRequest, match="kwargs_ref: not a multimodal input reference") as caught:
        MmRef.from_json(b'{"handle": 3}')
    assert caught.value.code == "invalid_kwargs_ref"


def test_split_keeps_order_and_field_settings():
    skeleton, arrays = split_item(ITEM)
    assert list(skeleton) == list(ITEM) and list(arrays) == ["pixel_values", "image_grid_thw"]
    assert skeleton["pixel_values"].data is None and skeleton["pixel_values"].field.kind == "flat"
