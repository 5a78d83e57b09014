"""Loading a checkpoint's tokenizer and multimodal processor without torchvision.

`AutoProcessor` on a Qwen-VL folder silently returns a bare tokenizer when
torchvision is missing (its video processor needs it), which would drop every
image.  We build the processor ourselves from the folder's tokenizer and PIL
image processor, with no video slot, and fail loudly when that is impossible.
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
    """A Qwen-VL processor (tokenizer + image processor, no video processor)."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tokenizer = load_tokenizer(model_path)
    image_processor = load_image_processor(model_path)
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template)
