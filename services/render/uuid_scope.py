"""The EC key of an item whose client sent a `uuid`: scoped by model and cache_salt, never the raw uuid.

A client `uuid` on an image part says "this is the same item as before":
vLLM uses it as the mm_hash as is (its encoder cache key), so a tenant that
reuses another tenant's uuid with another image is answered from the other
tenant's embedding (vllm-project/vllm#55439).  epd derives the key instead:

    sha256("epd-uuid-v1" + frame(model_id) + frame(cache_salt or "") + frame(uuid))  (hex)
    with frame(s) = 8-byte big-endian length of the UTF-8 bytes + the bytes
    and a flag byte telling "no cache_salt" from an empty one

so the same uuid under the same (model, cache_salt) names one entry, and under
another salt (another tenant) or another model a different one.  Items
without a uuid keep the content hash (services.render.hashing), which already
covers the model and the image bytes.  This is a deliberate, documented
difference from vLLM (docs/security.md, docs/protocol.md): mm_hashes of uuid
items differ from vLLM's; tenants are told apart by cache_salt, which the
gateway should set per tenant.

Who calls what: the render image pipeline (multimodal.py) derives the key
before it hashes an item.
"""

from __future__ import annotations

import hashlib

_DOMAIN = b"epd-uuid-v1"


def _frame(value: str) -> bytes:
    data = value.encode("utf-8")
    return len(data).to_bytes(8, "big") + data


def scoped_uuid(model_id: str, cache_salt: str | None, uuid: str) -> str:
    """The item key for a client uuid: equal for equal (model, cache_salt, uuid), different otherwise."""
    salted = b"\x01" + _frame(cache_salt) if cache_salt is not None else b"\x00"
    return hashlib.sha256(_DOMAIN + _frame(model_id) + salted + _frame(uuid)).hexdigest()
