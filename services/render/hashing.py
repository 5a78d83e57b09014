"""mm_hash: the content hash that names one multimodal item in every stage.

Render computes it once; encode uses it as the EC-store key, prefill as part of
its prefix-cache keys, so it must be identical across processes and hosts
(never Python's salted `hash()`).  Per PROTOCOL.md it is a hex SHA-256 over the
modality name, the original encoded media bytes, the model id and the
processor kwargs that change the output, taken in sorted key order.  A caller's
`uuid` replaces the hash as is (see `item_hash`).

Framing: for each field in sorted key order the digest absorbs the key, the
8-byte big-endian length of the value and the value, so no two different field
sets can produce the same byte stream.  Processor kwargs are canonical JSON
(sorted keys, no spaces).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# Image-processor settings that never change pixel_values / image_grid_thw.
_NON_OUTPUT_KEYS = frozenset({"image_processor_type", "processor_class", "auto_map"})


def mm_hash(modality: str, media: bytes, model_id: str, processor_kwargs: Mapping[str, Any]) -> str:
    """Hex SHA-256 of one item; equal inputs give equal hashes in any process."""
    fields = {
        "media": bytes(media),
        "modality": modality.encode("utf-8"),
        "model": model_id.encode("utf-8"),
        "processor_kwargs": canonical_json(processor_kwargs),
    }
    digest = hashlib.sha256()
    for key in sorted(fields):
        value = fields[key]
        digest.update(key.encode("utf-8"))
        digest.update(len(value).to_bytes(8, "big"))
        digest.update(value)
    return digest.hexdigest()


def item_hash(
    modality: str, media: bytes, model_id: str, processor_kwargs: Mapping[str, Any], uuid: str | None
) -> str:
    """The caller's uuid when given (used unchanged), else the content hash."""
    if uuid:
        return uuid
    return mm_hash(modality, media, model_id, processor_kwargs)


def canonical_json(value: Mapping[str, Any]) -> bytes:
    # Tuples and lists must hash alike (to_dict() yields either, depending on the source).
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_jsonable).encode("utf-8")


def output_kwargs(processor_settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of an image processor (`to_dict()`) that change its output."""
    return {
        key: value
        for key, value in processor_settings.items()
        if key not in _NON_OUTPUT_KEYS and not key.startswith("_")
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
