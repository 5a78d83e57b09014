"""Loading a checkpoint's tokenizer and multimodal processor without torchvision.

`AutoProcessor` on a Qwen-VL folder silently returns a bare tokenizer when
torchvision is missing (its video processor needs it), which would drop every
image.  We build the processor ourselves from the folder's tokenizer and PIL
image processor, with no video slot, and fail loudly when that is impossible.
The processor class follows the checkpoint's family (registry); a text-only
checkpoint's "processor" is its tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def load_image_processor(model_path: str | Path):
    """The PIL image processor declared by the folder (never the torchvision one)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_path), backend="pil")


def load_processor(model_path: str | Path) -> Any:
    """The family's processor (tokenizer + image processor, no video processor); the tokenizer if text-only."""
    from services.models.registry import adapter_for

    family = adapter_for(model_path).family
    tokenizer = load_tokenizer(model_path)
    if family == "causal_lm":
        return tokenizer
    if family == "llava":
        return _llava_processor(model_path, tokenizer)
    return _image_only(_qwen_processor_class(family))(
        image_processor=load_image_processor(model_path), tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _qwen_processor_class(family: str) -> type:
    import transformers

    names = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
    return getattr(transformers, names[family])


def _image_only(base: type) -> type:
    class ImageOnlyProcessor(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = f"ImageOnly{base.__name__}"
    return ImageOnlyProcessor


def _llava_processor(model_path: str | Path, tokenizer: Any) -> Any:
    import json

    from transformers import LlavaProcessor

    settings_file = Path(model_path) / "processor_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    keys = ("patch_size", "vision_feature_select_strategy", "image_token", "num_additional_image_tokens")
    return LlavaProcessor(image_processor=load_image_processor(model_path), tokenizer=tokenizer,
                          chat_template=tokenizer.chat_template, **{k: settings[k] for k in keys if k in settings})
