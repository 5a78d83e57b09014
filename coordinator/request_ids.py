"""Request ids are labels, not keys: what a client sends is echoed and logged, never used to name shared state.

A client names its request with X-Request-Id (or a generate body's
request_id); that *label* comes back in the response id ("chatcmpl-<label>",
"generate-tokens-<label>") and the X-Request-Id response header, as vLLM
does, and starts every log line's request id.  Everything stages key on (the
decode engine's request id, the KV store key, gRPC metadata) is the *internal
id*: the label plus a random suffix, unique per request, so two concurrent
requests with the same label both run and get their own answers.  Aborts by
id (admin.py, inflight.py) match labels, and only among requests made with
the same API key.
"""

from __future__ import annotations

import re
import uuid

from services.protocol.errors import InvalidRequest

_LABEL = re.compile(r"[\x20-\x7e]{1,256}")


def label_of(header: str | None, body_id: str | None = None) -> str:
    """The client's label (the header wins over the body), or a fresh one; 400 unless printable ASCII."""
    label = header or body_id or uuid.uuid4().hex
    if not _LABEL.fullmatch(label):
        raise InvalidRequest("request id (X-Request-Id or request_id) must be 1-256 printable ASCII characters",
                             code="invalid_request_id")
    return label


def internal_id(label: str) -> str:
    """The id every stage sees: unique per request, the label first so one grep finds both."""
    return f"{label}-{uuid.uuid4().hex[:12]}"
