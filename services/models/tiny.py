"""Tiny random checkpoints of every supported family, for exactness tests and `epd serve --model tiny-X`.

Each is built from a config with a fixed seed (initializer_range 0.1 in text
and vision configs, so that wrong positions change tokens), written once with
`save_pretrained` into the cache (EPD_CACHE_DIR) under a file lock, then
loaded like any checkpoint.  All share the real Qwen2 tokenizer (demo.py);
LLaVA adds an `<image>` token to it.  Families: qwen2_vl (the demo),
qwen2_5_vl, qwen3_vl, llava, qwen2 and llama (text-only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.models.demo import (
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN2_VL_IMAGE_PROCESSOR,
    TINY_TEXT,
    _mrope_section,
    build_qwen2_tokenizer,
    cached_build,
    default_cache_dir,
    demo_model_path,
)

_BUILD_VERSION = "1"
_VERSIONS = {"qwen3_vl": "2"}  # v2: a video processor config (write_qwen3_video_config)
SEED = 1234
VOCAB = 151936
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END, IM_END, ENDOFTEXT = 151655, 151656, 151652, 151653, 151645, 151643
LLAVA_IMAGE_TOKEN = "<image>"
QWEN_IDS: dict[str, Any] = {
    "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD, "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END, "eos_token_id": IM_END, "tie_word_embeddings": False}
TEXT: dict[str, Any] = {
    **TINY_TEXT, "vocab_size": VOCAB, "initializer_range": 0.1, "rms_norm_eps": 1e-6, "head_dim": 16,
    "eos_token_id": IM_END, "bos_token_id": ENDOFTEXT, "tie_word_embeddings": False}

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# llava-hf/llava-1.5's template, also accepting string content.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}"
    "{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
LLAVA_IMAGE_SIZE, LLAVA_PATCH = 112, 14


def tiny_model_path(family: str, cache_dir: Path | None = None) -> Path:
    """The tiny checkpoint of `family` (see FAMILIES), built on first use (idempotent, process-safe)."""
    if family == "qwen2_vl":
        return demo_model_path("tiny", cache_dir)
    if family not in FAMILIES:
        raise ValueError(f"no tiny checkpoint for {family!r}; known: {', '.join(sorted(FAMILIES))}")
    folder = (cache_dir or default_cache_dir()) / f"epd-tiny-{family}-v{_VERSIONS.get(family, _BUILD_VERSION)}"
    return cached_build(folder, FAMILIES[family])


def _save(folder: Path, model_class: type, config: Any, tokenizer: Any, processor: dict[str, Any] | None,
          chat_template: str) -> None:
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(SEED)
    model = model_class(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT, eos_token_id=[IM_END, ENDOFTEXT],
                                               pad_token_id=ENDOFTEXT, do_sample=False)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}, indent=2))


def _qwen_processor(cls: str, **overrides: Any) -> dict[str, Any]:
    return {**QWEN2_VL_IMAGE_PROCESSOR, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": cls,
            **overrides}


def build_qwen2_5_vl(folder: Path) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(16)}
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": rope},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": TEXT["hidden_size"], "window_size": 56, "fullatt_block_indexes": [1],
                       "initializer_range": 0.1},
        **QWEN_IDS)
    _save(folder, Qwen2_5_VLForConditionalGeneration, config, build_qwen2_tokenizer(),
          _qwen_processor("Qwen2_5_VLProcessor"), QWEN2_VL_CHAT_TEMPLATE)


def build_qwen3_vl(folder: Path) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": _mrope_section(16),
            "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={**TEXT, "rope_parameters": rope},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": TEXT["hidden_size"], "patch_size": 16, "num_position_embeddings": 576,
                       "deepstack_visual_indexes": [0, 1], "initializer_range": 0.1},
        **QWEN_IDS)
    processor = _qwen_processor("Qwen3VLProcessor", patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    _save(folder, Qwen3VLForConditionalGeneration, config, build_qwen2_tokenizer(), processor,
          QWEN2_VL_CHAT_TEMPLATE)
    write_qwen3_video_config(folder)


# The video processor settings Qwen3-VL checkpoints ship (video_preprocessor_config.json): their own class and
# pixel budget over all frames (Qwen3VLVideoProcessor's smart_resize), 16-pixel patches, 0.5 mean and std.
QWEN3_VL_VIDEO_PROCESSOR: dict[str, Any] = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor"}


def write_qwen3_video_config(folder: Path) -> None:
    (folder / "video_preprocessor_config.json").write_text(json.dumps(QWEN3_VL_VIDEO_PROCESSOR, indent=2))


def build_llava(folder: Path) -> None:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    tokenizer = build_qwen2_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE_TOKEN]})
    config = LlavaConfig(
        text_config={**TEXT, "model_type": "llama", "max_position_embeddings": 4096},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": LLAVA_IMAGE_SIZE,
                       "patch_size": LLAVA_PATCH, "projection_dim": 32, "initializer_range": 0.1},
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN), vision_feature_layer=-2,
        vision_feature_select_strategy="default", tie_word_embeddings=False)  # projector init: text's 0.1
    processor = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
                 "size": {"shortest_edge": LLAVA_IMAGE_SIZE},
                 "crop_size": {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}, "do_center_crop": True,
                 "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                 "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}
    _save(folder, LlavaForConditionalGeneration, config, tokenizer, processor, LLAVA_CHAT_TEMPLATE)
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "LlavaProcessor", "patch_size": LLAVA_PATCH, "image_token": LLAVA_IMAGE_TOKEN,
         "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}, indent=2))


def _build_text(folder: Path, config_class: str, model_class: str) -> None:
    import transformers

    config = getattr(transformers, config_class)(**{**TEXT, "max_position_embeddings": 4096})
    _save(folder, getattr(transformers, model_class), config, build_qwen2_tokenizer(), None, CHATML_TEMPLATE)


def build_qwen2(folder: Path) -> None:
    _build_text(folder, "Qwen2Config", "Qwen2ForCausalLM")


def build_llama(folder: Path) -> None:
    _build_text(folder, "LlamaConfig", "LlamaForCausalLM")


FAMILIES: dict[str, Callable[[Path], None]] = {
    "qwen2_5_vl": build_qwen2_5_vl, "qwen3_vl": build_qwen3_vl, "llava": build_llava,
    "qwen2": build_qwen2, "llama": build_llama,
}
