"""The context length every process uses: min(--max-model-len, what the checkpoint declares).  No torch.

One source of truth: the checkpoint's config.json (`max_position_embeddings`, the text config's first), capped
by --max-model-len.  Render checks prompts against it, prefill and decode size their engines with it, and the
coordinator reports it on /v1/models and checks generate requests with it, so no two of them disagree (a
4096-position checkpoint is 4096 everywhere, as vLLM reports it, whatever the flag's default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def declared_context(folder: str | Path) -> int | None:
    """The checkpoint's own context length (text config first), or None when config.json does not say."""
    try:
        config: Any = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for source in (config.get("text_config") or {}, config) if isinstance(config, dict) else ():
        value = source.get("max_position_embeddings") if isinstance(source, dict) else None
        if isinstance(value, int) and value > 1:
            return value
    return None


def context_length(configured: int, folder: str | Path) -> int:
    """--max-model-len capped by the checkpoint's declared context length."""
    declared = declared_context(folder)
    return configured if declared is None else min(configured, declared)
