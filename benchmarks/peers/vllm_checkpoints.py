"""Tiny random checkpoints that the real vLLM CPU backend can serve (head_dim 32).

vLLM's CPU attention needs head_dim >= 32; the demo model has 16 (hidden 64, 4
heads), and a head_dim-16 checkpoint kills vLLM's engine at its first request.
These are built exactly like the demo and the tiny families (services/models:
fixed seed, initializer_range 0.1, the real Qwen2 tokenizer, Qwen2-VL-2B's chat
template and image-processor settings) with hidden 128 / 4 heads (text) and
64 / 2 heads (vision), once, into the cache, under a file lock:

- `qwen2_vl`: the demo family (Qwen2-VL);
- `qwen2_5_vl`: a second family (Qwen2.5-VL: window attention, SwiGLU tower);
- `qwen3_vl`: the third (Qwen3-VL: deepstack features, learned position embeddings, 16-pixel patches, and a
  video processor config of its own, as the real checkpoints ship: `services.models.tiny.QWEN3_VL_VIDEO_PROCESSOR`).

The context is 4096 (`max_position_embeddings`), what vLLM is started with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.models.demo import QWEN2_VL_CHAT_TEMPLATE, _mrope_section, build_qwen2_tokenizer, default_cache_dir
from services.models.tiny import QWEN_IDS, TEXT, _qwen_processor, _save, cached_build, write_qwen3_video_config

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_VERSION = "1"
HEAD_DIM = 32
TEXT_HD32: dict[str, Any] = {**TEXT, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "head_dim": HEAD_DIM, "max_position_embeddings": 4096}
_ROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(HEAD_DIM)}


def checkpoint_path(family: str = "qwen2_vl", cache_dir: Path | None = None) -> Path:
    """The head_dim-32 checkpoint folder of `family`, built on first use (idempotent, process-safe)."""
    if family not in FAMILIES:
        raise ValueError(f"no head_dim-32 checkpoint for {family!r}; known: {', '.join(FAMILIES)}")
    folder = (cache_dir or default_cache_dir()) / f"epd-hd32-{family}-v{_VERSION}"
    return cached_build(folder, _BUILDERS[family])


def _build_qwen2_vl(folder: Path) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={**TEXT_HD32, "rope_parameters": _ROPE},
        vision_config={"depth": 2, "embed_dim": 64, "num_heads": 2, "mlp_ratio": 2,
                       "hidden_size": TEXT_HD32["hidden_size"], "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "initializer_range": 0.1},
        bos_token_id=151643, **QWEN_IDS)
    _save(folder, Qwen2VLForConditionalGeneration, config, build_qwen2_tokenizer(),
          _qwen_processor("Qwen2VLProcessor"), QWEN2_VL_CHAT_TEMPLATE)


def _build_qwen2_5_vl(folder: Path) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={**TEXT_HD32, "rope_parameters": _ROPE},
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                       "out_hidden_size": TEXT_HD32["hidden_size"], "window_size": 56,
                       "fullatt_block_indexes": [1], "initializer_range": 0.1},
        **QWEN_IDS)
    _save(folder, Qwen2_5_VLForConditionalGeneration, config, build_qwen2_tokenizer(),
          _qwen_processor("Qwen2_5_VLProcessor"), QWEN2_VL_CHAT_TEMPLATE)


def _build_qwen3_vl(folder: Path) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {**_ROPE, "rope_theta": 5e6, "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={**TEXT_HD32, "rope_parameters": rope},
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                       "out_hidden_size": TEXT_HD32["hidden_size"], "patch_size": 16, "num_position_embeddings": 576,
                       "deepstack_visual_indexes": [0], "initializer_range": 0.1},
        **QWEN_IDS)
    processor = _qwen_processor("Qwen3VLProcessor", patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    _save(folder, Qwen3VLForConditionalGeneration, config, build_qwen2_tokenizer(), processor, QWEN2_VL_CHAT_TEMPLATE)
    write_qwen3_video_config(folder)


_BUILDERS = {"qwen2_vl": _build_qwen2_vl, "qwen2_5_vl": _build_qwen2_5_vl, "qwen3_vl": _build_qwen3_vl}
