"""Keys of the EC (encoder cache) store: one entry per multimodal item, scoped by model.

Encode puts an item's embeddings under `ec_key(model_id, mm_hash)`; prefill
loads them by handle.  The same item under another model is another entry.
"""

from __future__ import annotations


def ec_key(model_id: str, mm_hash: str) -> str:
    if not model_id or not mm_hash:
        raise ValueError("ec_key needs a model id and an mm_hash")
    return f"{model_id}|{mm_hash}"
