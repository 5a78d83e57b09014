"""The kwargs_data / mm_metadata wire format of PROTOCOL.md, bit-exact.

One item is one msgpack map {key: {"data": nested, "field": [factory, factory_kw]}};
a tensor is [dtype, shape, ExtType(3, raw little-endian bytes)].  JSON carries
the bytes as standard, padded base64; gRPC carries them raw.

Decoding reads untrusted bytes: every failure is an InvalidRequest naming the
problem, extension types other than 3 (1 and 2 are pickles) are refused, and
sizes and nesting depth are bounded.  No torch here (render and the
coordinator use this module).
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from services.protocol.b64 import b64decode_strict, b64encode_text
from services.protocol.errors import EpdError, InvalidRequest
from services.protocol.items import FIELD_KINDS, FieldElem, FieldSpec, Item, Nested
from services.protocol.tensors import RawTensor, tensor_bytes, tensor_from_bytes, wire_dtype

TENSOR_EXT_TYPE = 3
DEFAULT_MAX_ITEM_BYTES = 256 * 1024 * 1024
MAX_NESTING_DEPTH = 16
_MAX_KEYS = 1024
_MAX_STR_LEN = 64 * 1024
_FACTORY_KEYS = {
    "batched": ("keep_on_cpu",),
    "flat": ("keep_on_cpu", "slices", "dim"),
    "shared": ("keep_on_cpu", "batch_size"),
}


class _Malformed(Exception):
    """A decoding problem; turned into InvalidRequest with the field path prepended."""


# ---- encoding -------------------------------------------------------------------------------------


def _pack_nested(data: Any) -> Any:
    if isinstance(data, np.ndarray | RawTensor):
        dims = list(data.shape)
        return [wire_dtype(data), dims, msgpack.ExtType(TENSOR_EXT_TYPE, tensor_bytes(data))]
    if isinstance(data, np.generic):
        data = data.item()
    if isinstance(data, bool) or not isinstance(data, int | float | list | tuple):
        raise ValueError(f"cannot serialize a {type(data).__name__} inside an item")
    if isinstance(data, list | tuple):
        return [_pack_nested(d) for d in data]
    return data


def _pack_elem(elem: FieldElem) -> dict[str, Any]:
    data = None if elem.data is None else _pack_nested(elem.data)
    return {"data": data, "field": [elem.field.kind, elem.field.factory_kw()]}


def encode_item(item: Mapping[str, FieldElem]) -> bytes:
    """An item as msgpack bytes (raw, as gRPC carries it)."""
    return msgpack.packb({key: _pack_elem(elem) for key, elem in item.items()}, use_bin_type=True)


def item_to_b64(item: Mapping[str, FieldElem]) -> str:
    """An item as padded standard base64 (as JSON carries it)."""
    return b64encode_text(encode_item(item))


# ---- decoding -------------------------------------------------------------------------------------


def _ext_hook(code: int, data: bytes) -> msgpack.ExtType:
    if code != TENSOR_EXT_TYPE:
        raise InvalidRequest(f"multimodal item: msgpack extension type {code} refused "
                             f"(only type {TENSOR_EXT_TYPE}, raw tensor bytes, is accepted)")
    return msgpack.ExtType(code, data)


def _unpack(data: bytes) -> Any:
    # Every length limit is bounded by the input size: msgpack preallocates an array of the
    # claimed length, so a 5-byte input claiming 2**28 elements must fail before allocating.
    size = len(data)
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_ext_hook,
            max_str_len=min(size, _MAX_STR_LEN), max_bin_len=size, max_array_len=size,
            max_map_len=min(size // 2, _MAX_KEYS), max_ext_len=size,
        )
    except EpdError:
        raise
    except Exception as exc:  # untrusted bytes: any decoder failure is the caller's fault
        raise InvalidRequest(f"multimodal item: malformed msgpack ({type(exc).__name__}: {exc})") from None


def _describe(value: Any) -> str:
    if isinstance(value, msgpack.Timestamp):
        return "a msgpack timestamp (extension type -1 refused)"
    if isinstance(value, bytes):
        return "raw binary (tensor bytes must be extension type 3)"
    return f"a {type(value).__name__}"


def _read_tensor(value: list[Any]) -> np.ndarray | RawTensor:
    if len(value) != 3:
        raise _Malformed(f"a tensor must be [dtype, shape, data], got {len(value)} elements")
    dtype, shape, raw = value
    if not isinstance(shape, list):
        raise _Malformed(f"tensor shape must be an array, got {_describe(shape)}")
    if not isinstance(raw, msgpack.ExtType):
        raise _Malformed(f"tensor data must be extension type 3, got {_describe(raw)}")
    try:
        return tensor_from_bytes(dtype, tuple(shape), raw.data)
    except ValueError as exc:
        raise _Malformed(str(exc)) from None


def _read_nested(value: Any, depth: int) -> Nested:
    if depth > MAX_NESTING_DEPTH:
        raise _Malformed(f"data nested deeper than {MAX_NESTING_DEPTH} levels")
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if not isinstance(value, list):
        raise _Malformed(f"data holds {_describe(value)}; expected a tensor, a number or an array")
    if value and isinstance(value[0], str):
        return _read_tensor(value)
    return [_read_nested(v, depth + 1) for v in value]


def _read_bool(kw: dict[str, Any], key: str) -> bool:
    value = kw.get(key, False)
    if not isinstance(value, bool):
        raise _Malformed(f"{key} must be a boolean, got {_describe(value)}")
    return value


def _read_field(value: Any) -> FieldSpec:
    if not isinstance(value, list) or len(value) != 2:
        raise _Malformed("field must be [factory_name, factory_kw]")
    kind, kw = value
    if kind not in _FACTORY_KEYS:
        raise _Malformed(f"unknown field factory {kind!r} (supported: {', '.join(FIELD_KINDS)})")
    if not isinstance(kw, dict):
        raise _Malformed(f"factory_kw must be a map, got {_describe(kw)}")
    unknown = sorted(set(kw) - set(_FACTORY_KEYS[kind]))
    if unknown:
        raise _Malformed(f"unknown {kind} factory setting(s) {unknown}")
    if kind == "flat" and not isinstance(kw.get("slices"), list):
        raise _Malformed("flat slices must be an array with one entry per item")
    if type(kw.get("dim", 0)) is not int:
        raise _Malformed("flat dim must be an integer")
    try:
        return FieldSpec(kind, _read_bool(kw, "keep_on_cpu"), slices=kw.get("slices"),
                         dim=kw.get("dim", 0), batch_size=kw.get("batch_size"))
    except ValueError as exc:
        raise _Malformed(str(exc)) from None


def _read_elem(value: Any) -> FieldElem:
    if not isinstance(value, dict):
        raise _Malformed(f"element must be a map, got {_describe(value)}")
    missing = [k for k in ("data", "field") if k not in value]
    if missing:
        raise _Malformed(f"element is missing {' and '.join(repr(k) for k in missing)}")
    unknown = sorted(set(value) - {"data", "field"})
    if unknown:
        raise _Malformed(f"element has unknown key(s) {unknown}")
    data = None if value["data"] is None else _read_nested(value["data"], 0)
    return FieldElem(data, _read_field(value["field"]))


def _read_item(obj: Any) -> Item:
    if not isinstance(obj, dict):
        raise InvalidRequest(f"multimodal item: must be a map of key to element, got {_describe(obj)}")
    item: Item = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not key:
            raise InvalidRequest(f"multimodal item: keys must be non-empty strings, got {key!r}")
        try:
            item[key] = _read_elem(value)
        except _Malformed as exc:
            raise InvalidRequest(f"multimodal item: key {key!r}: {exc}") from None
    return item


def decode_item(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Item:
    """Read one item from msgpack bytes; tensors are read-only numpy views (RawTensor for bf16)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidRequest(f"multimodal item: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise InvalidRequest(f"multimodal item: {len(data)} bytes exceeds the limit of {max_bytes}")
    return _read_item(_unpack(bytes(data)))


def item_from_b64(text: str, *, max_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Item:
    """Read one item from padded standard base64."""
    if not isinstance(text, str):
        raise InvalidRequest(f"multimodal item: expected a base64 string, got {type(text).__name__}")
    if len(text) > (max_bytes // 3 + 1) * 4:
        raise InvalidRequest(f"multimodal item: base64 text exceeds the limit of {max_bytes} bytes")
    try:
        raw = b64decode_strict(text)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"multimodal item: invalid base64 ({exc})") from None
    return decode_item(raw, max_bytes=max_bytes)
