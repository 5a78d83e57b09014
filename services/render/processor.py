"""The checkpoint's HF image processor, run on one image at a time.

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from services.models.base import RenderSpec
from services.models.processing import load_image_processor
from services.protocol.errors import InvalidRequest
from services.render.hashing import output_kwargs


@dataclass(frozen=True)
class ProcessedImage:
    arrays: dict[str, np.ndarray]   # processor key order, e.g. pixel_values, image_grid_thw[0]
    num_tokens: int                 # placeholder tokens (= image embeddings) the image occupies


class ImageProcessor:
    """Wraps a checkpoint's image processor: per-image arrays and placeholder counts."""

    def __init__(self, model_path: str | Path, spec: RenderSpec | None = None) -> None:
        self.hf = load_image_processor(model_path)
        self.tokens_per_image = spec.tokens_per_image if spec is not None else None
        self.merge_size = int(getattr(self.hf, "merge_size", 1) or 1)
        # Settings that change the output go into every mm_hash (two deployments with different
        # max_pixels must not share encoder-cache entries).
        self.hash_kwargs: dict[str, Any] = output_kwargs(self.hf.to_dict())

    def process(self, image: Image.Image) -> ProcessedImage:
        try:
            out = self.hf(images=[image], return_tensors="np")
        except ValueError as exc:  # e.g. an aspect ratio the processor cannot resize: the input's fault
            raise InvalidRequest(f"image of {image.width}x{image.height} px cannot be processed: {exc}",
                                 code="invalid_image") from None
        arrays = {key: np.asarray(value) for key, value in out.items()}
        if self.tokens_per_image is not None:
            return ProcessedImage(arrays, self.tokens_per_image)
        grid = arrays["image_grid_thw"]
        if grid.shape != (1, 3):
            raise ValueError(f"expected one image_grid_thw row, got shape {grid.shape}")
        arrays["image_grid_thw"] = np.ascontiguousarray(grid[0], dtype=np.int64)
        return ProcessedImage(arrays, self.num_tokens(arrays["image_grid_thw"]))

    def num_tokens(self, grid_thw: np.ndarray) -> int:
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.merge_size**2)
