from __future__ import annotations

import base64
import pickle

import msgpack
import numpy as np
import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.items import FieldElem, FieldSpec
from services.protocol.serialization import decode_item, encode_item, item_from_b64, item_to_b64
from services.protocol.tensors import RawTensor
from tests.support.tensors import bfloat16_to_float32

GOLDEN = ("ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAABAAAAAAAAAAEAAAAAAAAAKVmaWVsZJKnYmF0Y2hl"
          "ZIGra2VlcF9vbl9jcHXD")


def _grid_item() -> dict[str, FieldElem]:
    return {"image_grid_thw": FieldElem(np.array([1, 4, 4], dtype=np.int64), FieldSpec.batched(True))}


def _qwen_item() -> dict[str, FieldElem]:
    pixels = np.random.default_rng(0).standard_normal((16, 1176)).astype(np.float32)
    return {"pixel_values": FieldElem(pixels, FieldSpec.flat([(0, 16, None)])), **_grid_item()}


def _refused(data: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        decode_item(data)


def test_golden_vector_encodes_byte_for_byte():
    assert item_to_b64(_grid_item()) == GOLDEN


def test_golden_vector_decodes_and_reencodes_byte_for_byte():
    item = item_from_b64(GOLDEN)
    elem = item["image_grid_thw"]
    assert elem.field == FieldSpec("batched", keep_on_cpu=True)
    assert elem.data.dtype == np.int64 and elem.data.shape == (3,) and elem.data.tolist() == [1, 4, 4]
    assert item_to_b64(item) == GOLDEN


def test_realistic_qwen_item_round_trip_is_byte_and_value_exact():
    item = _qwen_item()
    raw = encode_item(item)
    back = decode_item(raw)
    assert list(back) == ["pixel_values", "image_grid_thw"]
    assert back["pixel_values"].field == FieldSpec("flat", slices=[(0, 16, None)], dim=0)
    assert back["pixel_values"].data.dtype == np.float32
    assert np.array_equal(back["pixel_values"].data, item["pixel_values"].data)
    assert np.array_equal(back["image_grid_thw"].data, [1, 4, 4])
    assert encode_item(back) == raw


def test_wire_layout_matches_the_spec():
    item = _qwen_item()
    pixels = item["pixel_values"].data
    expected = msgpack.packb({
        "pixel_values": {"data": ["float32", [16, 1176], msgpack.ExtType(3, pixels.astype("<f4").tobytes())],
                         "field": ["flat", {"keep_on_cpu": False, "slices": [[0, 16, None]], "dim": 0}]},
        "image_grid_thw": {"data": ["int64", [3], msgpack.ExtType(3, np.array([1, 4, 4], "<i8").tobytes())],
                           "field": ["batched", {"keep_on_cpu": True}]},
    }, use_bin_type=True)
    assert encode_item(item) == expected
    shared = {"k": FieldElem([1, 2.5], FieldSpec.shared(batch_size=2))}
    assert encode_item(shared) == msgpack.packb(
        {"k": {"data": [1, 2.5], "field": ["shared", {"keep_on_cpu": False, "batch_size": 2}]}})


def test_bfloat16_round_trip():
    bits = np.array([[0x3F80, 0xC000], [0x3F00, 0x0000]], dtype="<u2")
    item = {"embeds": FieldElem(RawTensor("bfloat16", (2, 2), bits.tobytes()), FieldSpec.batched())}
    raw = encode_item(item)
    back = decode_item(raw)["embeds"].data
    assert isinstance(back, RawTensor) and back.shape == (2, 2) and back.data == bits.tobytes()
    assert bfloat16_to_float32(back).tolist() == [[1.0, -2.0], [0.5, 0.0]]
    assert encode_item(decode_item(raw)) == raw


def test_nested_lists_scalars_and_null_data():
    item = {
        "frames": FieldElem([np.ones((2,), np.float16), [np.zeros((1,), np.uint8), 7]], FieldSpec.batched()),
        "empty": FieldElem([], FieldSpec.batched()),
        "absent": FieldElem(None, FieldSpec.batched()),
        "flag": FieldElem(np.array([True, False]), FieldSpec.batched()),
    }
    raw = encode_item(item)
    back = decode_item(raw)
    assert back["frames"].data[1][1] == 7 and back["frames"].data[0].dtype == np.float16
    assert back["empty"].data == [] and back["absent"].data is None
    assert back["flag"].data.tolist() == [True, False]
    assert encode_item(back) == raw


def test_encoder_refuses_what_the_format_cannot_carry():
    with pytest.raises(ValueError, match="cannot be serialized"):
        encode_item({"x": FieldElem(np.zeros(2, np.complex64), FieldSpec.batched())})
    with pytest.raises(ValueError, match="cannot serialize a str"):
        encode_item({"x": FieldElem(["a"], FieldSpec.batched())})


@pytest.mark.parametrize("code", [1, 2, 5])
def test_extension_types_other_than_3_are_refused(code):
    payload = pickle.dumps(object)
    as_tensor = {"x": {"data": ["int64", [1], msgpack.ExtType(code, payload)],
                       "field": ["batched", {"keep_on_cpu": False}]}}
    _refused(msgpack.packb(as_tensor), f"extension type {code} refused")
    _refused(msgpack.packb({"x": {"data": msgpack.ExtType(code, payload), "field": ["batched", {}]}}),
             f"extension type {code} refused")
    _refused(msgpack.packb(msgpack.ExtType(code, payload)), f"extension type {code} refused")


def test_truncated_and_garbage_bytes_are_refused():
    raw = base64.b64decode(GOLDEN)
    for cut in (1, 5, len(raw) // 2, len(raw) - 1):
        _refused(raw[:cut], "malformed msgpack")
    _refused(b"\xc1", "malformed msgpack")
    _refused(raw + b"\x00", "malformed msgpack")
    _refused(b"", "malformed msgpack")
    _refused(bytes(range(256)), "multimodal item")


def _elem(data=None, field=None, **extra):
    value = {"data": data, "field": field or ["batched", {"keep_on_cpu": False}], **extra}
    return msgpack.packb({"x": value})


@pytest.mark.parametrize(("packed", "match"), [
    (msgpack.packb([1, 2]), "must be a map"),
    (msgpack.packb({"x": 5}), "element must be a map"),
    (msgpack.packb({"x": {"field": ["batched", {}]}}), "missing 'data'"),
    (msgpack.packb({"x": {"data": None}}), "missing 'field'"),
    (msgpack.packb({1: {"data": None, "field": ["batched", {}]}}), "malformed msgpack"),
    (_elem(field=["stacked", {}]), "unknown field factory 'stacked'"),
    (_elem(field=["batched"]), "field must be \\[factory_name, factory_kw\\]"),
    (_elem(field=["batched", {"keep_on_cpu": 1}]), "keep_on_cpu must be a boolean"),
    (_elem(field=["batched", {"slices": []}]), "unknown batched factory setting"),
    (_elem(field=["flat", {"keep_on_cpu": False, "slices": [[0, 1.5, None]], "dim": 0}]),
     "slice \\[0, 1.5, None\\] must be \\[start, stop, step\\]"),
    (_elem(field=["flat", {"keep_on_cpu": False, "slices": 3, "dim": 0}]), "flat slices must be an array"),
    (_elem(field=["shared", {"keep_on_cpu": False}]), "batch_size"),
    (_elem(data=["int64", [4], msgpack.ExtType(3, b"\0" * 24)]), "needs 32 bytes, got 24"),
    (_elem(data=["int4", [1], msgpack.ExtType(3, b"\0")]), "unknown dtype 'int4'"),
    (_elem(data=["uint8", [2**40, 2**40], msgpack.ExtType(3, b"\0")]), "needs \\d+ bytes, got 1"),
    (_elem(data=["uint8", [1] * 40, msgpack.ExtType(3, b"\0")]), "more than 32"),
    (_elem(data=["uint8", [1.5], msgpack.ExtType(3, b"\0")]), "non-negative integers"),
    (_elem(data=["uint8", [1], b"\0"]), "must be extension type 3"),
    (_elem(data=["uint8", [1]]), "must be \\[dtype, shape, data\\]"),
    (_elem(data=[True]), "data holds a bool"),
    (_elem(data={"a": 1}), "data holds a dict"),
    (_elem(data=b"\0\0"), "raw binary"),
    (_elem(data=msgpack.Timestamp(0)), "extension type -1 refused"),
    (_elem(data=[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]), "nested deeper"),
    (_elem(extra_key=1), "unknown key"),
])
def test_malformed_items_name_the_problem(packed, match):
    _refused(packed, match)


def test_decoder_bounds_sizes():
    raw = encode_item(_qwen_item())
    with pytest.raises(InvalidRequest, match="exceeds the limit"):
        decode_item(raw, max_bytes=len(raw) - 1)
    with pytest.raises(InvalidRequest, match="exceeds the limit"):
        item_from_b64(base64.b64encode(raw).decode(), max_bytes=1000)
    with pytest.raises(InvalidRequest, match="expected bytes"):
        decode_item("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["abc$", GOLDEN[:-1], GOLDEN.replace("+", "-") + "-_"])
def test_invalid_base64_is_refused(text):
    with pytest.raises(InvalidRequest, match="invalid base64"):
        item_from_b64(text)


def test_base64_of_non_item_is_refused():
    with pytest.raises(InvalidRequest, match="multimodal item"):
        item_from_b64(base64.b64encode(b"hello").decode())
    with pytest.raises(InvalidRequest, match="expected a base64 string"):
        item_from_b64(None)  # type: ignore[arg-type]


def test_decoded_tensors_are_read_only_views():
    array = decode_item(encode_item(_grid_item()))["image_grid_thw"].data
    assert not array.flags.writeable


def test_huge_claimed_lengths_fail_before_allocating():
    # array32 / map32 headers claiming 2**28 entries, with no entries behind them
    _refused(b"\xdd\x10\x00\x00\x00", "malformed msgpack")
    _refused(b"\xdf\x10\x00\x00\x00", "malformed msgpack")
    _refused(b"\xc9\x10\x00\x00\x00\x03", "malformed msgpack")  # ext32 of 256 MiB, 0 bytes present
