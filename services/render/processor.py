"""The checkpoint's image processing, run on one image at a time.

Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) get vLLM's exact pixels: raw uint8 patches
resized as torchvision does (`qwen_pixels.py`), normalised later at the encoder.  Other
families (LLaVA's CLIP processor) run the checkpoint's HF PIL processor, float32 normalised,
which is also what vLLM sends for them.

Render processes each image on its own (not as a batch) because every image
becomes its own item with its own mm_hash; the Qwen-VL and CLIP processors
treat the images of a batch independently, so the per-image arrays are exactly
the rows the batched call would produce.  Arrays are numpy
(`return_tensors="np"`): render never imports torch.  How many placeholder
tokens an image takes follows the family's `RenderSpec`: a fixed count
(LLaVA) or image_grid_thw / merge_size**2 (Qwen-VL).  Calls are CPU-heavy and
blocking; `RenderService` runs them in its bounded thread pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from services.models.base import RenderSpec
from services.models.processing import load_image_processor
from services.protocol.errors import InvalidRequest
from services.render.qwen_pixels import QwenPixelSettings, qwen_pixels, resample_kernel


@dataclass(frozen=True)
class ProcessedImage:
    arrays: dict[str, np.ndarray]   # processor key order, e.g. pixel_values, image_grid_thw[0]
    num_tokens: int                 # placeholder tokens (= image embeddings) the image occupies
    info: dict[str, Any] = field(default_factory=dict)  # a video's mm_hash and timestamps (video_processor.py)


class ImageProcessor:
    """Wraps a checkpoint's image processor: per-image arrays and placeholder counts."""

    def __init__(self, model_path: str | Path, spec: RenderSpec | None = None) -> None:
        self.hf = load_image_processor(model_path)
        self.tokens_per_image = spec.tokens_per_image if spec is not None else None
        self.merge_size = int(getattr(self.hf, "merge_size", 1) or 1)
        self.qwen = QwenPixelSettings.from_processor(self.hf)
        if self.qwen is not None:
            resample_kernel()  # loaded now, not on the first image

    def process(self, image: Image.Image) -> ProcessedImage:
        try:
            arrays = self._arrays(image)
        except ValueError as exc:  # e.g. an aspect ratio the processor cannot resize: the input's fault
            raise InvalidRequest(f"image of {image.width}x{image.height} px cannot be processed: {exc}",
                                 code="invalid_image") from None
        if self.tokens_per_image is not None:
            return ProcessedImage(arrays, self.tokens_per_image)
        return ProcessedImage(arrays, self.num_tokens(arrays["image_grid_thw"]))

    def _arrays(self, image: Image.Image) -> dict[str, np.ndarray]:
        if self.qwen is not None:
            return qwen_pixels(image, self.qwen)
        out = self.hf(images=[image], return_tensors="np")
        arrays = {key: np.asarray(value) for key, value in out.items()}
        grid = arrays.get("image_grid_thw")
        if grid is not None:
            if grid.shape != (1, 3):
                raise ValueError(f"expected one image_grid_thw row, got shape {grid.shape}")
            arrays["image_grid_thw"] = np.ascontiguousarray(grid[0], dtype=np.int64)
        return arrays

    def num_tokens(self, grid_thw: np.ndarray) -> int:
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.merge_size**2)
