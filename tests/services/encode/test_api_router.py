"""Encode's HTTP adapter rules that need no vision tower: which items it takes and how they decode."""

from __future__ import annotations

import base64

import msgpack
import pytest

from services.encode.api_router import _kwargs, _unique_items
from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateRequest

GOLDEN = ("ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAABAAAAAAAAAAEAAAAAAAAAKVmaWVsZJKnYmF0Y2hl"
          "ZIGra2VlcF9vbl9jcHXD")


def _request(hashes=("a",), kwargs=GOLDEN, **extra):
    places = [{"offset": 1 + 2 * i, "length": 1} for i in range(len(hashes))]
    features = {"mm_hashes": {"image": list(hashes)}, "mm_placeholders": {"image": places},
                "kwargs_data": {"image": [kwargs] * len(hashes)}}
    return GenerateRequest.model_validate({"token_ids": list(range(8)), "features": features, **extra})


def test_items_are_deduplicated_by_hash():
    assert list(_unique_items(_request(hashes=("a", "b", "a")))) == ["a", "b"]


def test_no_items_and_content_parts_are_refused():
    with pytest.raises(InvalidRequest, match="at least one multimodal item"):
        _unique_items(GenerateRequest.model_validate({"token_ids": [1]}))
    parts = GenerateRequest.model_validate({"token_ids": [1], "content_parts": [{"type": "image_url", "url": "x"}]})
    with pytest.raises(InvalidRequest, match="not content_parts"):
        _unique_items(parts)


def test_golden_item_decodes_and_null_means_resolve_by_hash():
    [item] = _unique_items(_request()).values()
    assert _kwargs(item)["image_grid_thw"].data.tolist() == [1, 4, 4]
    [empty] = _unique_items(_request(kwargs=None)).values()
    assert _kwargs(empty) is None


@pytest.mark.parametrize("ext_type", [1, 2, 5])
def test_extension_types_other_than_3_are_refused(ext_type):
    payload = {"x": {"data": ["int64", [1], msgpack.ExtType(ext_type, b"\0" * 8)], "field": ["batched", {
        "keep_on_cpu": False}]}}
    bad = base64.b64encode(msgpack.packb(payload, use_bin_type=True)).decode()
    [item] = _unique_items(_request(kwargs=bad)).values()
    with pytest.raises(InvalidRequest, match=rf"features.kwargs_data.image\[0\]: .*extension type {ext_type} refused"):
        _kwargs(item)
