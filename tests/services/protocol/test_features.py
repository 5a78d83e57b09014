from __future__ import annotations

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.features import ContentPart, MultiModalFeatures, PlaceholderRange
from services.protocol.parsing import parse_model


def _features(**override) -> dict:
    body = {
        "mm_hashes": {"image": ["h0", "h1"], "video": ["v0"]},
        "mm_placeholders": {"image": [{"offset": 2, "length": 4}, {"offset": 20, "length": 4}],
                            "video": [{"offset": 10, "length": 6}]},
        "kwargs_data": {"image": ["k0", None], "video": ["kv"]},
        "mm_metadata": {"image": ["m0", "m1"], "video": [None]},
    }
    return {**body, **override}


def _error(body: dict) -> str:
    with pytest.raises(InvalidRequest) as caught:
        parse_model(MultiModalFeatures, body)
    return caught.value.message


def test_items_in_prompt_order():
    features = parse_model(MultiModalFeatures, _features())
    order = [(i.modality, i.index, i.mm_hash, i.placeholder.offset, i.kwargs_b64, i.metadata_b64)
             for i in features.items()]
    assert order == [("image", 0, "h0", 2, "k0", "m0"), ("video", 0, "v0", 10, "kv", None),
                     ("image", 1, "h1", 20, None, "m1")]
    assert features.num_items == 3 and features.has_metadata_only_items()


def test_optional_maps():
    features = parse_model(MultiModalFeatures, _features(kwargs_data=None, mm_metadata=None))
    assert all(i.kwargs_b64 is None and i.metadata_b64 is None for i in features.items())
    assert not features.has_metadata_only_items()


def test_modality_key_sets_must_match():
    message = _error(_features(mm_metadata={"image": ["m0", "m1"]}))
    assert message == ("modality keys differ: mm_hashes ['image', 'video'], mm_placeholders "
                       "['image', 'video'], kwargs_data ['image', 'video'], mm_metadata ['image']")


def test_list_lengths_must_match():
    message = _error(_features(kwargs_data={"image": ["k0"], "video": ["kv"]}))
    assert message == ("modality 'image' has list lengths that differ: mm_hashes 2, mm_placeholders 2, "
                       "kwargs_data 1, mm_metadata 2")


def test_placeholder_rules():
    bad = _features(mm_placeholders={"image": [{"offset": -1, "length": 4}, {"offset": 20, "length": 0}],
                                     "video": [{"offset": 10, "length": 6}]})
    assert _error(bad) == ("mm_placeholders.image[0].offset: must be >= 0; "
                           "mm_placeholders.image[1].length: must be > 0")


def test_unsorted_ranges_within_a_modality_are_accepted_as_vllm_does():
    # vLLM sorts the flattened ranges before its overlap check; items are taken in prompt order either way.
    body = _features(mm_placeholders={"image": [{"offset": 20, "length": 4}, {"offset": 2, "length": 4}],
                                      "video": [{"offset": 10, "length": 6}]})
    features = MultiModalFeatures.model_validate(body)
    assert [item.placeholder.offset for item in features.items()] == [2, 10, 20]


def test_ranges_must_not_overlap_across_modalities():
    body = _features(mm_placeholders={"image": [{"offset": 2, "length": 9}, {"offset": 20, "length": 4}],
                                      "video": [{"offset": 10, "length": 6}]})
    assert _error(body) == ("mm_placeholders: ranges overlap: image[0] covers [2, 11) and "
                            "video[0] covers [10, 16)")


def test_adjacent_ranges_are_fine_and_hashes_non_empty():
    body = _features(mm_placeholders={"image": [{"offset": 2, "length": 8}, {"offset": 16, "length": 4}],
                                      "video": [{"offset": 10, "length": 6}]})
    assert parse_model(MultiModalFeatures, body).items()[1].placeholder.end == 16
    empty_hash = _features(mm_hashes={"image": ["h0", ""], "video": ["v"]})
    assert _error(empty_hash) == "mm_hashes.image: hashes must be non-empty strings"


def test_placeholder_range_and_content_part():
    assert PlaceholderRange(offset=3, length=4).end == 7
    part = parse_model(ContentPart, {"type": "video_url", "url": "http://x/v.mp4", "uuid": "abc"})
    assert part.modality == "video" and part.uuid == "abc"
    with pytest.raises(InvalidRequest, match="type: must be 'image_url', 'audio_url' or 'video_url'"):
        parse_model(ContentPart, {"type": "file", "url": "x"})
