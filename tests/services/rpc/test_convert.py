from __future__ import annotations

from services.rpc.convert import metadata_only, sampling_from_pb, sampling_to_pb
from services.rpc.v1 import epd_pb2 as pb


def test_sampling_round_trip_keeps_unset_fields_unset():
    params = {"max_tokens": 7, "temperature": 0.0, "seed": 42, "stop": "END", "stop_token_ids": [5]}
    back = sampling_from_pb(sampling_to_pb(params))
    assert back["max_tokens"] == 7 and back["temperature"] == 0.0 and back["seed"] == 42
    assert back["stop"] == ["END"] and back["stop_token_ids"] == [5]
    assert back["top_p"] is None and back["top_k"] is None
    assert back["skip_special_tokens"] is True  # vLLM's default when unset


def test_metadata_only_drops_pixels():
    item = pb.MultiModalItem(modality="image", mm_hash="h", offset=3, length=4, kwargs_data=b"x" * 1000,
                             mm_metadata=b"meta")
    light = metadata_only(item)
    assert light.kwargs_data == b"" and light.mm_metadata == b"meta"
    assert (light.offset, light.length, light.mm_hash) == (3, 4, "h")
