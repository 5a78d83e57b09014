"""Reading SSE streams in tests."""

from __future__ import annotations

import json
from typing import Any


def parse_sse_data(line: bytes | str) -> Any | None:
    """The JSON of one `data: ...` line; None for [DONE], blank lines and comments."""
    text = line.decode("utf-8") if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("data:"):
        return None
    body = text[len("data:"):].strip()
    return None if body == "[DONE]" else json.loads(body)
