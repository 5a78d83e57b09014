"""JSON-array mm_metadata (vLLM #56090's idea) and PlaceholderRange.is_embed (vLLM #54548, an extension)."""

from __future__ import annotations

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.features import MultiModalFeatures, PlaceholderRange
from services.protocol.generate import GenerateRequest
from services.protocol.metadata_json import b64_to_json, item_from_json, json_to_b64
from services.protocol.parsing import validate_model

# vLLM's mm_metadata item of a 4x4 Qwen2-VL grid (tests/services/render/test_render_api_router.py's golden vector)
GOLDEN = ("ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAABAAAAAAAAAAEAAAAAAAAAKVmaWVsZJKnYmF0Y2hl"
          "ZIGra2VlcF9vbl9jcHXD")


def _features(entry, length=4, **place):
    return {"mm_hashes": {"image": ["h0"]}, "mm_placeholders": {"image": [{"offset": 2, "length": length, **place}]},
            "mm_metadata": {"image": [entry]}}


def test_json_grid_is_vllms_msgpack_item_byte_for_byte():
    assert json_to_b64({"image_grid_thw": [1, 4, 4]}) == GOLDEN
    assert b64_to_json(GOLDEN) == {"image_grid_thw": [1, 4, 4]}
    elem = item_from_json({"image_grid_thw": [1, 4, 4]})["image_grid_thw"]
    assert (elem.data.dtype.name, elem.data.tolist(), elem.field.kind, elem.field.keep_on_cpu) == \
        ("int64", [1, 4, 4], "batched", True)
    assert item_from_json({"second_per_grid_ts": [0.5]})["second_per_grid_ts"].data.dtype.name == "float32"


def test_generate_accepts_json_and_base64_entries_as_the_same_item():
    as_json = MultiModalFeatures.model_validate(_features({"image_grid_thw": [1, 4, 4]}))
    as_b64 = MultiModalFeatures.model_validate(_features(GOLDEN))
    assert as_json.mm_metadata == as_b64.mm_metadata == {"image": [GOLDEN]}
    body = {"token_ids": [1, 2, 3, 3, 3, 3, 4], "features": _features({"image_grid_thw": [1, 4, 4]}),
            "ec_transfer_params": {"h0": {"backend": "shm"}}}
    assert validate_model(GenerateRequest, body).features.items()[0].metadata_b64 == GOLDEN


@pytest.mark.parametrize(("entry", "message"), [
    ({"image_grid_thw": [1, "4", 4]}, "image_grid_thw: must be a rectangular array of at most 4096 numbers "
                                      "(no strings, booleans or nulls)"),
    ({"image_grid_thw": [[1, 4], [4]]}, "image_grid_thw: nested arrays must be rectangular"),
    ({"image_grid_thw": True}, "image_grid_thw: must be a number or a (nested) array of numbers"),
    ({"image_grid_thw": [None]}, "image_grid_thw: must be a rectangular array of at most 4096 numbers"),
    ({"image_grid_thw": list(range(5000))}, "image_grid_thw: must be a rectangular array of at most 4096"),
])
def test_bad_json_metadata_is_a_400_naming_the_entry(entry, message):
    with pytest.raises(InvalidRequest) as err:
        validate_model(MultiModalFeatures, _features(entry))
    assert err.value.status == 400
    assert f"mm_metadata.image[0]: {message}" in err.value.message


def test_is_embed_is_carried_checked_and_left_out_when_null():
    place = PlaceholderRange(offset=2, length=3, is_embed=[True, True, True])
    assert place.model_dump() == {"offset": 2, "length": 3, "is_embed": [True, True, True]}
    assert PlaceholderRange(offset=2, length=3).model_dump_json() == '{"offset":2,"length":3}'
    body = {"token_ids": [1, 2, 3, 3, 3, 3, 4], "features": _features(GOLDEN, is_embed=[True] * 4),
            "ec_transfer_params": {"h0": {"backend": "shm"}}}
    assert validate_model(GenerateRequest, body).features.mm_placeholders["image"][0].is_embed == [True] * 4
    with pytest.raises(InvalidRequest) as err:
        validate_model(MultiModalFeatures, _features(GOLDEN, is_embed=[True, True]))
    assert "is_embed has 2 entries for a placeholder of length 4" in err.value.message
    sparse = validate_model(MultiModalFeatures, _features(GOLDEN, is_embed=[False, True, True, False]))
    assert sparse.mm_placeholders["image"][0].is_embed == [False, True, True, False]   # a Qwen3-VL video's form
    with pytest.raises(InvalidRequest) as err:
        validate_model(MultiModalFeatures, _features(GOLDEN, is_embed=[False] * 4))
    assert "is_embed marks no placeholder token as an embedding" in err.value.message
