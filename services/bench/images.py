"""Seeded synthetic images as data URLs, and the pool that controls image reuse.

As in vLLM's random-mm dataset the pixels are uniform noise, so image size
alone decides the encoder's work and nothing about the content helps a cache.
Every image is a pure function of (seed, image key): two runs, or the two
endpoints of a compare run, send byte-identical images.

Reuse: with `pool_size` N > 0, the first N images of a run are the N pool
images in order (so every pool image appears once), later ones are drawn from
the pool uniformly at random. A run with T >= N images therefore sends exactly
N distinct images and, with a perfect cache, hits on 1 - N/T of its items.
With N = 0 every image is unique.
"""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
from PIL import Image

from .config import ImageSize

_SIZE_STREAM = 1
_PIXEL_STREAM = 2
_DRAW_STREAM = 3


def encode_data_url(pixels: np.ndarray, fmt: str) -> str:
    buffer = io.BytesIO()
    image = Image.fromarray(pixels, "RGB")
    if fmt == "jpeg":
        image.save(buffer, format="JPEG", quality=90)
    else:
        image.save(buffer, format="PNG", compress_level=1)
    return f"data:image/{fmt};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class ImageFactory:
    """Image key -> data URL. Pool images are cached; unique ones are built on demand."""

    def __init__(self, sizes: tuple[ImageSize, ...], pool_size: int, fmt: str, seed: int) -> None:
        self.sizes = sizes
        self.pool_size = pool_size
        self.fmt = fmt
        self.seed = seed
        weights = np.array([s.weight for s in sizes], dtype=np.float64)
        self._probs = weights / weights.sum()
        self._cache: dict[int, str] = {}
        self._lock = threading.Lock()  # the prefetch thread and the caller may both build

    def size_of(self, key: int) -> ImageSize:
        rng = np.random.default_rng([self.seed, _SIZE_STREAM, key])
        return self.sizes[int(rng.choice(len(self.sizes), p=self._probs))]

    def key_for(self, image_index: int) -> int:
        """The key of the run's `image_index`-th image (pool index, or a fresh key when unpooled)."""
        if self.pool_size == 0 or image_index < self.pool_size:
            return image_index
        rng = np.random.default_rng([self.seed, _DRAW_STREAM, image_index])
        return int(rng.integers(self.pool_size))

    def data_url(self, key: int) -> str:
        if self.pool_size == 0:
            return self._build(key)
        with self._lock:
            cached = self._cache.get(key)
        if cached is None:
            cached = self._build(key)
            with self._lock:
                self._cache[key] = cached
        return cached

    def _build(self, key: int) -> str:
        size = self.size_of(key)
        rng = np.random.default_rng([self.seed, _PIXEL_STREAM, key])
        pixels = rng.integers(0, 256, size=(size.height, size.width, 3), dtype=np.uint8)
        return encode_data_url(pixels, self.fmt)
