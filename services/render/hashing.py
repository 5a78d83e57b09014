"""mm_hash: the content hash that names one multimodal item in every stage, equal to vLLM's.

Render computes it once; encode uses it as the EC-store key, prefill as part of
its prefix-cache keys, so it must be identical across processes and hosts
(never Python's salted `hash()`).  It is vLLM's (0.32/0.33) `MultiModalHasher.hash_kwargs`
for an image given as encoded bytes, so a mixed deployment (epd render with vLLM encoders, or
the reverse) and llm-d's encoder-cache affinity scorer agree on keys:

    blake3 over, for each keyword in sorted order (image=..., model_id=..., and
    mm_processor_kwargs=... only when a deployment overrides processor settings):
        frame(key) + value
    where frame(b) = len(b) as 8 bytes little-endian + b, and a value is tagged:
        None 0x00 | sequence 0x01 + len + items | mapping 0x02 + len + (frame(key) + value)...
        | leaf 0x03 + frame(bytes)   (str: UTF-8; int/float/bool: numpy's bytes of the scalar)
    and the image itself is the leaf-tagged item ("image", original encoded bytes).

A video is hashed as vLLM hashes what its loader returns, the pair (the video, the loader's metadata
dict): the original bytes as ("video", bytes), or, when the sampled frames take fewer bytes than the
file, the frames themselves as ("video", ("ndarray", {dtype, shape, data})) (`video_hash`).

`model_id` is the model as vLLM is given it (the checkpoint path or hub name), not the served
name.  An item with a client uuid is named by uuid_scope (model, cache_salt, uuid) instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from blake3 import blake3

_TAG_NONE, _TAG_SEQUENCE, _TAG_MAPPING, _TAG_LEAF = b"\x00", b"\x01", b"\x02", b"\x03"


def _length(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield _length(len(chunk))
    yield chunk


def _leaf(obj: Any) -> Iterator[bytes]:
    if isinstance(obj, bytes | bytearray | memoryview):
        return _framed(bytes(obj))
    if isinstance(obj, str):
        return _framed(obj.encode("utf-8"))
    if isinstance(obj, int | float):
        return _framed(np.array(obj).tobytes())
    raise TypeError(f"cannot hash a {type(obj).__name__}")


class _Media:
    """An item given as encoded bytes: vLLM's MediaWithBytes, hashed as the pair (modality, bytes)."""

    def __init__(self, modality: str, data: bytes) -> None:
        self.modality, self.data = modality, bytes(data)


def _value(obj: Any) -> Iterator[bytes]:
    if obj is None:
        yield _TAG_NONE
    elif isinstance(obj, list | tuple):
        yield _TAG_SEQUENCE
        yield _length(len(obj))
        for elem in obj:
            yield from _value(elem)
    elif isinstance(obj, Mapping):
        yield _TAG_MAPPING
        yield _length(len(obj))
        for key, elem in obj.items():
            yield from _framed(str(key).encode("utf-8"))
            yield from _value(elem)
    elif isinstance(obj, _Media):
        yield _TAG_LEAF
        yield from _keyword(obj.modality, obj.data)
    else:
        yield _TAG_LEAF
        yield from _leaf(obj)


def _keyword(key: str, obj: Any) -> Iterator[bytes]:
    yield from _framed(key.encode("utf-8"))
    yield from _value(obj)


def mm_hash(modality: str, media: bytes, model_id: str,
            mm_processor_kwargs: Mapping[str, Any] | None = None) -> str:
    """vLLM's hash of one item given as its original encoded bytes; equal inputs, equal hashes anywhere."""
    keywords: dict[str, Any] = {modality: _Media(modality, media), "model_id": model_id}
    if mm_processor_kwargs:
        keywords["mm_processor_kwargs"] = dict(mm_processor_kwargs)
    digest = blake3()
    for key in sorted(keywords):
        for chunk in _keyword(key, keywords[key]):
            digest.update(chunk)
    return digest.hexdigest()


class _Frames:
    """Decoded frames, hashed as vLLM hashes an ndarray: ("ndarray", {dtype, shape, data})."""

    def __init__(self, frames: np.ndarray) -> None:
        self.fields = {"dtype": frames.dtype.str, "shape": tuple(int(d) for d in frames.shape),
                       "data": np.ascontiguousarray(frames).view(np.uint8).data}


def _video_value(data: bytes, frames: np.ndarray) -> Iterator[bytes]:
    yield _TAG_LEAF
    yield from _framed(b"video")
    if frames.nbytes < len(data):
        yield _TAG_LEAF
        yield from _keyword("ndarray", _Frames(frames).fields)
    else:
        yield _TAG_LEAF
        yield from _framed(bytes(data))


def video_hash(data: bytes, frames: np.ndarray, metadata: Mapping[str, Any], model_id: str) -> str:
    """vLLM's mm_hash of a video: keywords model_id and video=(the video, the loader's metadata)."""
    digest = blake3()
    for chunk in _keyword("model_id", model_id):
        digest.update(chunk)
    for chunk in _framed(b"video"):
        digest.update(chunk)
    digest.update(_TAG_SEQUENCE + _length(2))
    for chunk in _video_value(data, frames):
        digest.update(chunk)
    for chunk in _value(dict(metadata)):
        digest.update(chunk)
    return digest.hexdigest()
