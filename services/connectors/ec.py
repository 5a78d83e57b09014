"""Keys of the EC (encoder cache) store: one entry per multimodal item, scoped by model and weight version.

Encode puts an item's embeddings under `ec_key(model_id, mm_hash, weight_version)`; prefill
loads them by handle.  The same item under another model, or made by other weights (a weight
update: services/weights/role.py), is another entry.
"""

from __future__ import annotations


def ec_key(model_id: str, mm_hash: str, weight_version: str = "") -> str:
    if not model_id or not mm_hash:
        raise ValueError("ec_key needs a model id and an mm_hash")
    return f"{model_id}|{weight_version}|{mm_hash}" if weight_version else f"{model_id}|{mm_hash}"


def ec_key_version(key: str) -> str:
    """The weight version an EC key names ("" for a key made without one)."""
    parts = key.rsplit("|", 2)
    return parts[1] if len(parts) == 3 else ""
