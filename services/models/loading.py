"""Loading checkpoint parts through `from_pretrained`, and the facts read beside them.

Shared by every adapter: dtype names, a strict part loader (a missing weight is
an error, never a silently random-initialised tensor), and the stop tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.protocol.errors import InvalidRequest

DTYPES = ("auto", "float32", "bfloat16", "float16")


class InvalidMultiModalInput(InvalidRequest, ValueError):
    """An item does not match the prompt (wrong range, wrong token, wrong size)."""


class ModelLoadError(RuntimeError):
    """A checkpoint could not be loaded as the requested part."""


def torch_dtype(name: str) -> Any:
    """"float32" | "bfloat16" | "float16" -> torch dtype; "auto" -> None (the checkpoint's own)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(DTYPES)}")
    return None if name == "auto" else getattr(torch, name)


def load_part(cls: Any, path: str | Path, device: str, dtype: str) -> Any:
    """`cls.from_pretrained(path)` in eval mode on `device`; fails if any of its weights is missing."""
    wanted = torch_dtype(dtype)
    model, info = cls.from_pretrained(str(path), dtype=wanted or "auto", output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ModelLoadError(f"{path}: {cls.__name__} is missing weights {sorted(info['missing_keys'])[:8]} "
                             f"or has mismatched ones {sorted(info['mismatched_keys'])[:8]}")
    return model.to(device).eval().requires_grad_(False)


def read_config(path: str | Path) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (not a model folder)")
    return json.loads(config_file.read_text())


def eos_token_ids(path: str | Path, config: Any) -> tuple[int, ...]:
    """Stop tokens: generation_config.json's eos_token_id (int or list), then the config's."""
    ids: list[int] = []
    generation_file = Path(path) / "generation_config.json"
    if generation_file.is_file():
        ids += _as_list(json.loads(generation_file.read_text()).get("eos_token_id"))
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for source in (config, text_config):
        ids += _as_list(getattr(source, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
