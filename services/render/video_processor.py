"""One video's bytes -> its kwargs arrays, placeholder size and mm_hash (run by a render worker).

The steps vLLM's render takes for a Qwen-VL video, in order: open and check the headers
(video_decode.py), pick the frames (video_sampling.py), decode just those, patch them
(qwen_video.py), then hash the video as vLLM hashes it (services.render.hashing.video_hash, which
needs the loader's metadata: so the hash is made here, next to the frames, not before the decode as
for images).  The arrays, in vLLM's key order:

- `video_grid_thw` [3] int64 (batched, kept on the CPU): frame groups, patch rows, patch columns;
- `second_per_grid_ts` (Qwen2.5-VL) float32 scalar: temporal_patch_size / sampled fps; render writes it
  in the model dtype, as vLLM does (features.py);
- `timestamps` (Qwen3-VL) the mean time in seconds of each frame group's first and last frame;
- `pixel_values_videos` [groups*h*w, C*T*P*P] uint8 (flat).

`ProcessedImage.info` carries the mm_hash, the sampling metadata (transformers' VideoMetadata fields) and,
for Qwen3-VL, the timestamps the prompt spells out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.protocol.errors import InvalidRequest
from services.render.hashing import video_hash
from services.render.processor import ProcessedImage
from services.render.qwen_video import QwenVideoSettings, resized_size, video_patches
from services.render.video_decode import TOO_LONG, OpenVideo, VideoBounds
from services.render.video_sampling import hf_metadata, sample, sampled_fps, timestamps


@dataclass(frozen=True)
class VideoProcessor:
    settings: QwenVideoSettings
    bounds: VideoBounds
    max_frames: int          # frames after sampling (each costs a resize and its patches)
    hash_model_id: str       # vLLM's model_id in mm_hash: the model as given
    max_tokens: int | None = None   # the context: a video that alone takes more is refused before decoding

    def process(self, data: bytes) -> ProcessedImage:
        settings = self.settings
        with OpenVideo(data, self.bounds) as video:
            indices = sample(settings.loader, video.info, settings.temporal_patch_size)
            if len(indices) > self.max_frames:
                raise InvalidRequest(f"video samples to {len(indices)} frames > max_video_frames={self.max_frames}",
                                     code=TOO_LONG)
            self._check_tokens(len(indices), video.info.height, video.info.width)
            frames, found = video.read(indices)
            source = video.info
        metadata = hf_metadata(settings.loader, source, found)
        pixels, grid = video_patches(frames, settings)
        arrays: dict[str, np.ndarray] = {}
        info: dict[str, object] = {"mm_hash": video_hash(data, frames, metadata, self.hash_model_id),
                                   "metadata": {k: v for k, v in metadata.items() if k != "do_sample_frames"}}
        if settings.timestamps:
            stamps = timestamps(metadata, settings.temporal_patch_size)
            arrays["timestamps"] = np.array(stamps, dtype=np.float64)
            info["timestamps"] = stamps
        arrays["video_grid_thw"] = grid
        if settings.second_per_grid:
            seconds = settings.temporal_patch_size / sampled_fps(metadata)
            arrays["second_per_grid_ts"] = np.array(seconds, dtype=np.float32)
        arrays["pixel_values_videos"] = pixels
        return ProcessedImage(arrays, int(np.prod(grid)) // settings.merge_size**2, info)

    def _check_tokens(self, frames: int, height: int, width: int) -> None:
        """The video's placeholder count, from its header and the frames to sample: one that cannot fit the
        context is refused before a frame is decoded."""
        if self.max_tokens is None:
            return
        settings = self.settings
        new_h, new_w = resized_size(frames, height, width, settings)
        groups = -(-frames // settings.temporal_patch_size)
        tokens = groups * (new_h // settings.patch_size) * (new_w // settings.patch_size) // settings.merge_size**2
        if tokens >= self.max_tokens:
            raise InvalidRequest(f"the video alone takes {tokens} tokens ({frames} frames of {width}x{height}), more "
                                 f"than the model's context of {self.max_tokens}", code="context_length_exceeded")
