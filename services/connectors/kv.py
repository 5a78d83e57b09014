"""Keys of the KV store: one entry per prefill, written by prefill, read once by decode (by handle), released.

A request id is a client's label, not unique (coordinator/request_ids.py; a
role's HTTP API takes X-Request-Id as sent), so the key adds a random part:
two prefills of requests with the same id never overwrite each other's entry.
The id stays first, for logs and debugging; the weight version that made the KV follows it (decode
checks the version itself: kv_transfer_params.weight_version).
"""

from __future__ import annotations

import uuid


def kv_key(request_id: str, weight_version: str = "") -> str:
    if not request_id:
        raise ValueError("kv_key needs a request id")
    scope = f"{weight_version}|" if weight_version else ""
    return f"req|{request_id}|{scope}{uuid.uuid4().hex[:12]}"
