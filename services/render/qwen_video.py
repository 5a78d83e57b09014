"""Qwen-VL video pixels exactly as vLLM's render produces them: raw uint8 patches of the sampled frames.

vLLM (0.32) runs the checkpoint's HF video processor on transformers' torchvision backend with rescale
and normalise off (the model normalises, as for images: services.models.input_norm).  Per family:

- `Qwen2VLVideoProcessor` (Qwen2-VL and Qwen2.5-VL): every frame resized to `smart_resize(h, w)` within
  [min_pixels, max_pixels] per frame;
- `Qwen3VLVideoProcessor` (Qwen3-VL): the pixel budget covers all frames (its own `smart_resize` over
  frames x height x width), and a video needs at least `temporal_patch_size` frames;

then each frame is resized as torchvision resizes a uint8 tensor (bicubic, antialias: `resize_uint8`,
the image path's bit-exact port), the frames are padded to a multiple of `temporal_patch_size` with the
last one, and cut into patches of temporal_patch_size frames x patch x patch, in the processor's
order (`patchify`): rows are frame groups, then merged blocks, then patches inside a block.

Settings come from the checkpoint's `video_preprocessor_config.json`, else `preprocessor_config.json`
(what AutoVideoProcessor reads), over the class defaults; the class is the config's
`video_processor_type`, else the family's (vLLM's choice, which also picks the frame sampling).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.protocol.errors import InvalidRequest
from services.render.qwen_pixels import resize_uint8
from services.render.video_decode import INVALID
from services.render.video_sampling import QWEN2_LOADER, QWEN3_LOADER

QWEN2_CLASS, QWEN3_CLASS = "Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor"
# Class defaults (transformers 5.x): pixels (shortest, longest edge), patch size.
_DEFAULTS = {QWEN2_CLASS: (128 * 28 * 28, 28 * 28 * 768, 14), QWEN3_CLASS: (128 * 32 * 32, 32 * 32 * 768, 16)}
_FAMILY_CLASS = {"qwen2_vl": QWEN2_CLASS, "qwen2_5_vl": QWEN2_CLASS, "qwen3_vl": QWEN3_CLASS}


@dataclass(frozen=True)
class QwenVideoSettings:
    """The video processor settings that decide the frames and pixels (plus what the family adds)."""

    processor_class: str
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    second_per_grid: bool = False   # Qwen2.5-VL: second_per_grid_ts per video
    timestamps: bool = False        # Qwen3-VL: frame timestamps in the prompt and the item

    @property
    def loader(self) -> str:
        return QWEN3_LOADER if self.processor_class == QWEN3_CLASS else QWEN2_LOADER

    @classmethod
    def from_checkpoint(cls, path: str | Path, family: str) -> QwenVideoSettings | None:
        """The settings of a Qwen-VL checkpoint's video processor; None for a family without one."""
        if family not in _FAMILY_CLASS:
            return None
        config = _video_config(Path(path))
        kind = config.get("video_processor_type") or _FAMILY_CLASS[family]
        if kind not in _DEFAULTS:
            return None
        low, high, patch = _DEFAULTS[kind]
        size = config.get("size") or {}
        low = int(config.get("min_pixels") or size.get("shortest_edge") or low)
        high = int(config.get("max_pixels") or size.get("longest_edge") or high)
        return cls(kind, low, high, int(config.get("patch_size") or patch), int(config.get("merge_size") or 2),
                   int(config.get("temporal_patch_size") or 2), second_per_grid=family == "qwen2_5_vl",
                   timestamps=family == "qwen3_vl")


def _video_config(folder: Path) -> dict[str, Any]:
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        file = folder / name
        if file.is_file():
            config = json.loads(file.read_text())
            return config.get("video_processor", config) if name.startswith("video") else config
    return {}


def resized_size(num_frames: int, height: int, width: int, settings: QwenVideoSettings) -> tuple[int, int]:
    """The size every frame is resized to, as the family's video processor picks it."""
    factor = settings.patch_size * settings.merge_size
    try:
        if settings.processor_class == QWEN3_CLASS:
            return _qwen3_size(num_frames, height, width, settings.temporal_patch_size, factor,
                               settings.min_pixels, settings.max_pixels)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=factor, min_pixels=settings.min_pixels,
                            max_pixels=settings.max_pixels)
    except ValueError as exc:   # an aspect ratio beyond 200:1, too few frames
        raise InvalidRequest(f"video of {num_frames} frames of {width}x{height} cannot be processed: {exc}",
                             code=INVALID) from None


def _qwen3_size(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen3_vl video smart_resize (the pixel budget spans the frames)."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_patches(frames: np.ndarray, settings: QwenVideoSettings) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values_videos [groups*h*w, C*T*P*P] uint8, video_grid_thw [groups, h, w]) of [n, H, W, 3] frames."""
    count, height, width, channels = frames.shape
    new_h, new_w = resized_size(count, height, width, settings)
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    resized = np.empty((count + (-count % t), channels, new_h, new_w), dtype=np.uint8)
    for i, frame in enumerate(frames):
        resized[i] = resize_uint8(frame.transpose(2, 0, 1), new_h, new_w)
    resized[count:] = resized[count - 1]   # the last frame repeated up to a whole temporal patch
    grid_t, grid_h, grid_w = resized.shape[0] // t, new_h // p, new_w // p
    patches = resized.reshape(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixels = np.ascontiguousarray(patches).reshape(grid_t * grid_h * grid_w, channels * t * p * p)
    return pixels, np.array([grid_t, grid_h, grid_w], dtype=np.int64)
