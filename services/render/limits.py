"""Per-request bounds that Render enforces before any heavy work.

Every limit breach is an `InvalidRequest` (400) naming the limit and the value
seen, so a caller can tell which knob to turn.  `max_model_len=None` means "the
checkpoint's own context length" (resolved by `RenderService`).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.protocol.errors import InvalidRequest

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096       # decompression-bomb guard; the processor resizes anyway
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
_POSITIVE = ("max_images_per_request", "max_image_pixels", "max_image_bytes", "max_video_bytes", "max_video_frames",
             "max_video_frame_pixels")


@dataclass(frozen=True)
class RenderLimits:
    max_images_per_request: int = 8
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_model_len: int | None = None
    max_videos_per_request: int = 2
    max_video_bytes: int = 32 * 1024 * 1024
    max_video_frames: int = 64
    max_video_duration_s: float = 300.0
    max_video_frame_pixels: int = 1920 * 1088
    video_decode_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RenderLimits.{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_videos_per_request, int) or self.max_videos_per_request < 0:
            raise ValueError(f"RenderLimits.max_videos_per_request must be an int >= 0, "
                             f"got {self.max_videos_per_request!r}")
        for name in ("max_video_duration_s", "video_decode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RenderLimits.{name} must be > 0, got {getattr(self, name)!r}")
        max_len = self.max_model_len
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 2):
            raise ValueError(f"RenderLimits.max_model_len must be an int >= 2 or None, got {max_len!r}")

    def check_image_count(self, num_images: int) -> None:
        if num_images > self.max_images_per_request:
            raise InvalidRequest(
                f"too many images: {num_images} > max_images_per_request={self.max_images_per_request}",
                code="too_many_images",
            )

    def check_video_count(self, num_videos: int) -> None:
        if num_videos > self.max_videos_per_request:
            raise InvalidRequest(
                f"too many videos: {num_videos} > max_videos_per_request={self.max_videos_per_request}",
                code="too_many_videos",
            )

    def check_image(self, width: int, height: int, num_bytes: int) -> None:
        """Backstop after decoding (the media policy is tightened to these limits beforehand)."""
        if num_bytes > self.max_image_bytes:
            raise InvalidRequest(f"{num_bytes} bytes > max_image_bytes={self.max_image_bytes}",
                                 code="media_too_large")
        if width * height > self.max_image_pixels:
            raise InvalidRequest(f"{width}x{height}={width * height} pixels > "
                                 f"max_image_pixels={self.max_image_pixels}", code="image_too_large")


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Prompt plus requested output must fit; with no max_tokens at least one token must fit."""
    wanted = num_prompt_tokens + (max_tokens if max_tokens is not None else 1)
    if wanted > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens if max_tokens is not None else 1} for the completion).",
            code="context_length_exceeded",
        )
