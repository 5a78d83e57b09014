"""Prefill's HTTP adapter rules that need no model: which items it takes, and the first token's finish."""

from __future__ import annotations

import numpy as np
import pytest

from services.prefill.api_router import first_token_finish, prefill_item
from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateRequest
from services.protocol.items import FieldElem, FieldSpec
from services.protocol.serialization import item_to_b64

GRID = FieldElem(np.array([1, 4, 4], dtype=np.int64), FieldSpec.batched(keep_on_cpu=True))
OTHER_GRID = FieldElem(np.array([1, 2, 8], dtype=np.int64), FieldSpec.batched(keep_on_cpu=True))
PIXELS = FieldElem(np.zeros((16, 1176), dtype=np.float32), FieldSpec.flat([(0, 16, None)]))
KEYS = ("image_grid_thw",)


def _item(kwargs=None, metadata=None, ec=None):
    features = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 4}]},
                "kwargs_data": {"image": [kwargs]} if kwargs else None,
                "mm_metadata": {"image": [metadata]} if metadata else None}
    request = GenerateRequest.model_validate({"token_ids": list(range(8)), "features": features,
                                              "ec_transfer_params": ec})
    return request.items()[0]


def test_kwargs_without_a_handle_are_kept_only_for_an_inline_encode():
    """Without a handle prefill looks the item up by mm_hash (serving); the pixels are kept for an inline encode
    when this instance encodes, dropped when it does not (a miss is then ec_entry_missing)."""
    kwargs = item_to_b64({"pixel_values": PIXELS, "image_grid_thw": GRID})
    kept = prefill_item(_item(kwargs=kwargs), {}, KEYS, encodes=True)
    assert kept.kwargs is not None and kept.kwargs["pixel_values"].data.shape == (16, 1176)
    assert list(kept.metadata) == ["image_grid_thw"]
    assert prefill_item(_item(kwargs=kwargs), {}, KEYS, encodes=False).kwargs is None
    assert prefill_item(_item(kwargs=kwargs), {"h": {}}, KEYS, encodes=True).kwargs is None  # a handle: no pixels


def test_with_a_handle_the_light_keys_come_from_metadata_else_from_kwargs():
    kwargs = item_to_b64({"pixel_values": PIXELS, "image_grid_thw": GRID})
    from_kwargs = prefill_item(_item(kwargs=kwargs), {"h": {}}, KEYS)
    assert list(from_kwargs.metadata) == ["image_grid_thw"]
    metadata = item_to_b64({"image_grid_thw": OTHER_GRID})
    both = prefill_item(_item(kwargs=kwargs, metadata=metadata, ec={"h": {}}), {"h": {}}, KEYS)
    assert both.metadata["image_grid_thw"].data.tolist() == [1, 2, 8]  # metadata wins
    assert (both.offset, both.length, both.mm_hash) == (1, 4, "h")


def test_an_item_needs_metadata_or_kwargs():
    with pytest.raises(InvalidRequest, match="prefill needs mm_metadata"):
        prefill_item(_item(), {"h": {}}, KEYS)


@pytest.mark.parametrize("token,sampling,expected", [
    (7, {}, ("length", None)),
    (2, {}, ("stop", None)),
    (2, {"ignore_eos": True}, ("length", None)),
    (2, {"min_tokens": 3, "max_tokens": 5}, ("length", None)),
    (9, {"stop_token_ids": [9]}, ("stop", 9)),
])
def test_first_token_finish(token, sampling, expected):
    assert first_token_finish(token, sampling, eos_ids=(2,)) == expected


def test_openai_format_prefill_asks_render_for_metadata_only_when_it_has_handles():
    from services.prefill.api_router import _payload

    assert _payload({"ec_transfer_params": {"h": {"backend": "shm"}}}) == "metadata"
    assert _payload({"ec_transfer_params": {}}) == "tensors"
    assert _payload({"messages": []}) == "tensors"
