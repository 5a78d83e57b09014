"""Keys of the KV store: one entry per request, written by prefill, read once by decode, then released."""

from __future__ import annotations


def kv_key(request_id: str) -> str:
    if not request_id:
        raise ValueError("kv_key needs a request id")
    return f"req|{request_id}"
