"""The coordinator's generate input step and answer helpers, without a cluster."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from coordinator.decode_stream import stop_reason
from coordinator.steps.generate_input import check_fits, rendered_from_features
from services.protocol.answers import protocol_finish_reason as finish_reason
from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateRequest
from services.protocol.items import FieldElem, FieldSpec
from services.protocol.sampling import SamplingParams
from services.protocol.serialization import decode_item, encode_item, item_to_b64
from services.rpc.convert import sampling_to_pb

GRID = FieldElem(np.array([1, 4, 4], dtype=np.int64), FieldSpec.batched(keep_on_cpu=True))
PIXELS = FieldElem(np.ones((16, 1176), dtype=np.float32), FieldSpec.flat([(0, 16, None)]))


def _request(kwargs=True, metadata=True, **extra):
    features = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 4}]}}
    if kwargs:
        features["kwargs_data"] = {"image": [item_to_b64({"pixel_values": PIXELS, "image_grid_thw": GRID})]}
    if metadata:
        features["mm_metadata"] = {"image": [item_to_b64({"image_grid_thw": GRID})]}
    return GenerateRequest.model_validate({"token_ids": list(range(8)), "features": features, **extra})


def test_kwargs_go_to_the_encode_item_and_metadata_to_prefill():
    [item] = rendered_from_features(_request(), "m").items
    assert (item.modality, item.mm_hash, item.offset, item.length) == ("image", "h", 1, 4)
    assert list(decode_item(item.kwargs_data)) == ["pixel_values", "image_grid_thw"]
    assert item.mm_metadata == encode_item({"image_grid_thw": GRID})


def test_missing_metadata_is_taken_from_kwargs():
    [item] = rendered_from_features(_request(metadata=False), "m").items
    assert item.mm_metadata == encode_item({"image_grid_thw": GRID})


def test_metadata_only_item_sends_no_pixels():
    [item] = rendered_from_features(_request(kwargs=False, ec_transfer_params={"h": {"k": 1}}), "m").items
    assert item.kwargs_data == b"" and item.mm_metadata


def test_bad_base64_is_a_400():
    request = _request()
    request.features.kwargs_data["image"][0] = "@@not base64@@"
    with pytest.raises(InvalidRequest, match=r"features.kwargs_data.image\[0\]: not valid base64"):
        rendered_from_features(request, "m")
    assert base64.b64decode(item_to_b64({"image_grid_thw": GRID}), validate=True)


def test_context_check():
    check_fits(10, None, 11)
    with pytest.raises(InvalidRequest, match="maximum context length is 11"):
        check_fits(10, 2, 11)


def test_stop_reason_from_grpc_text():
    sampling = sampling_to_pb(SamplingParams(stop=["7"], stop_token_ids=[151645]).model_dump())
    assert stop_reason("", sampling) is None
    assert stop_reason("151645", sampling) == 151645
    assert stop_reason("7", sampling) == "7"
    assert stop_reason("END", sampling) == "END"


def test_finish_reason_from_grpc_text():
    assert [finish_reason(t) for t in ("", "stop", "length", "abort", "error", "weird")] == \
        [None, "stop", "length", "abort", "error", "error"]


def test_features_are_stored_once_and_travel_by_handle_without_torch(tmp_path):
    """In a process where torch cannot be imported (as in the coordinator): decode, store, forward a handle."""
    import json
    import subprocess
    import sys

    request = _request().model_dump_json()
    script = (
        "import sys, json; sys.modules['torch'] = None\n"
        "from coordinator.steps.generate_input import rendered_from_features\n"
        "from services.connectors.base import StoreConfig\n"
        "from services.connectors.registry import create_store\n"
        "from services.protocol.generate import GenerateRequest\n"
        "from services.protocol.items import item_payload_nbytes\n"
        "from services.protocol.serialization import decode_item\n"
        "store = create_store(StoreConfig('shm', 'mm', sys.argv[2], capacity_bytes=1 << 22, preallocate=False))\n"
        "req = GenerateRequest.model_validate_json(open(sys.argv[1]).read())\n"
        "[item] = rendered_from_features(req, 'm', store).items\n"
        "ref = json.loads(item.kwargs_ref_json)\n"
        "print(json.dumps({'inline_tensor_bytes': item_payload_nbytes(decode_item(item.kwargs_data)),\n"
        "                  'stored': [t['name'] for t in ref['handle']['tensors']],\n"
        "                  'copied': store.stats().bytes_copied, 'torch': sys.modules['torch'] is None}))\n"
        "store.close()\n")
    path = tmp_path / "req.json"
    path.write_text(request)
    out = subprocess.run([sys.executable, "-c", script, str(path), "gen" + tmp_path.name[-8:].replace("-", "")],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == {"inline_tensor_bytes": 0, "stored": ["pixel_values", "image_grid_thw"],
                                      "copied": 16 * 1176 * 4 + 24, "torch": True}


def test_a_large_item_without_an_mm_store_travels_whole():
    pixels = FieldElem(np.arange(600_000, dtype=np.uint8).reshape(1000, 600) % 251, FieldSpec.flat([(0, 1000, None)]))
    request = _request()
    request.features.kwargs_data["image"][0] = item_to_b64({"pixel_values": pixels, "image_grid_thw": GRID})
    [item] = rendered_from_features(request, "m").items
    assert isinstance(item.kwargs_data, bytes) and len(item.kwargs_data) > 600_000
    assert np.array_equal(decode_item(item.kwargs_data)["pixel_values"].data, pixels.data)
