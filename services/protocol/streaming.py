"""Server-sent events as PROTOCOL.md frames them: `data: <json>\\n\\n`, ending with `data: [DONE]\\n\\n`.

Errors after the stream started travel in-stream as `data: {"error": {...}}`.
Pure framing, no transport: routes write these bytes to the response.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from services.protocol.errors import EpdError

SSE_DONE = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event carrying a model (or an already-built dict) as compact JSON."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode("utf-8") + b"\n\n"


def sse_error(error: EpdError) -> bytes:
    """The in-stream form of an error."""
    return sse_event(error.to_body())
