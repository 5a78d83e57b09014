"""Which frames of a video a Qwen-VL prompt sees: vLLM's (0.32) frame sampling, bit for bit, without torch.

vLLM picks the loader by the checkpoint's video processor class, and each loader samples at 2 frames
per second of video (capped at 30), at least 4 and at most 768 frames:

- `Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL): the count floored to a multiple of the temporal
  patch size (2), indices `torch.arange(0, total, total / n).int()` (float32 values; `arange_indices`
  reproduces torch's CPU kernel: the step multiplied in double, each value rounded to float32, then
  truncated), the last clamped to the last frame;
- `Qwen3VLVideoProcessor` (Qwen3-VL): `int(total / fps * 2)` frames, indices
  `np.linspace(0, total - 1, n).round()`; an unknown source fps counts as 24.

`hf_metadata` is the metadata dict vLLM hands the HF processor and hashes into the item's mm_hash
(key order included), and `sampled_fps` / `timestamps` what Qwen2.5-VL's `second_per_grid_ts` and
Qwen3-VL's frame timestamps are computed from, as transformers' processors compute them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from services.protocol.errors import InvalidRequest
from services.render.video_decode import INVALID, SourceInfo

TARGET_FPS = 2.0      # vLLM's loaders' default fps (media_io_kwargs may not change it through epd)
MAX_FPS = 30.0
MIN_FRAMES = 4
MAX_FRAMES = 768
QWEN2_LOADER, QWEN3_LOADER = "qwen2_vl", "qwen3_vl"


def arange_indices(total: int, count: int) -> list[int]:
    """`torch.arange(0, total, total / count).int()` clamped to total - 1, as torch computes it on a CPU."""
    step = total / count
    size = math.ceil(total / step)
    values = (np.arange(size, dtype=np.float64) * step).astype(np.float32).astype(np.int32)
    return np.minimum(values, total - 1).tolist()


def qwen2_indices(source: SourceInfo, temporal_patch_size: int) -> list[int]:
    """vLLM's Qwen2VLVideoBackend.compute_frames_index_to_sample."""
    total, fps = source.total_frames, source.fps
    if fps <= 0:
        raise InvalidRequest("video has no known frame rate (variable or unknown fps)", code=INVALID)
    most = math.floor(min(MAX_FRAMES, total) / temporal_patch_size) * temporal_patch_size
    count = total / fps * min(TARGET_FPS, MAX_FPS)
    count = min(max(count, MIN_FRAMES), most, total)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    if count <= 0:
        raise InvalidRequest(f"video has {total} frame(s) to show; the model needs at least {temporal_patch_size}",
                             code=INVALID)
    return arange_indices(total, count)


def qwen3_fps(source: SourceInfo) -> float:
    """Qwen3VLVideoBackend._prepare_source: an unknown fps is taken as 24 (HF's assumption)."""
    return source.fps if source.fps > 0 else 24.0


def qwen3_indices(source: SourceInfo) -> list[int]:
    """vLLM's Qwen3VLVideoBackend.compute_frames_index_to_sample."""
    total = source.total_frames
    count = int(total / qwen3_fps(source) * min(TARGET_FPS, MAX_FPS))
    count = min(max(count, MIN_FRAMES), MAX_FRAMES, total)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def sample(loader: str, source: SourceInfo, temporal_patch_size: int) -> list[int]:
    if loader == QWEN3_LOADER:
        return qwen3_indices(source)
    return qwen2_indices(source, temporal_patch_size)


def hf_metadata(loader: str, source: SourceInfo, found: list[int]) -> dict[str, Any]:
    """vLLM's VideoLoader.create_hf_metadata (Qwen3-VL's with its fps fix-up), in its key order.
    "opencv" names vLLM's decoder: the dict is part of the mm_hash, which must equal vLLM's."""
    fps = qwen3_fps(source) if loader == QWEN3_LOADER else source.fps
    return {"total_num_frames": source.total_frames, "fps": fps, "duration": source.duration,
            "video_backend": "opencv", "frames_indices": list(found),
            "do_sample_frames": len(found) == source.total_frames}


def sampled_fps(metadata: dict[str, Any]) -> float:
    """transformers' VideoMetadata.sampled_fps."""
    return len(metadata["frames_indices"]) / metadata["total_num_frames"] * metadata["fps"]


def timestamps(metadata: dict[str, Any], temporal_patch_size: int) -> list[float]:
    """Qwen3VLProcessor._calculate_timestamps: the mean time of each temporal patch's first and last frame."""
    indices = list(metadata["frames_indices"])
    if len(indices) % temporal_patch_size:
        indices.extend(indices[-1] for _ in range(temporal_patch_size - len(indices) % temporal_patch_size))
    seconds = [index / metadata["fps"] for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]
