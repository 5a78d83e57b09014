"""Test videos, made on the spot with PyAV (never downloaded): the bench's clip maker (services/bench/videos.py).

A *recording* is a deterministic sequence of frames; `clip` encodes frames [start, start + count) of one.
The default codec is H.264 with every frame a key frame and a fixed quantiser, so a frame decodes to the same
pixels in every clip that holds it: two clips of one recording that overlap share their frame groups (what
the encoder's frame-group cache reuses), as segments cut from a stream at key frames would.
"""

from __future__ import annotations

import base64

from services.bench.videos import encode_clip, frame  # noqa: F401  (frame: for tests that need the pixels)

MIME = {"mp4": "video/mp4", "webm": "video/webm", "matroska": "video/x-matroska", "avi": "video/x-msvideo"}


def clip(count: int = 8, width: int = 224, height: int = 224, fps: float = 4.0, *, recording: int = 0,
         start: int = 0, codec: str = "libx264", options: dict[str, str] | None = None,
         container: str = "mp4") -> bytes:
    return encode_clip(count, width, height, fps, recording=recording, start=start, codec=codec, options=options,
                       container=container)


def data_url(data: bytes, container: str = "mp4") -> str:
    return f"data:{MIME[container]};base64," + base64.b64encode(data).decode()


def video_part(data: bytes, container: str = "mp4", uuid: str | None = None) -> dict:
    """An OpenAI chat content part (vLLM's shape)."""
    part: dict = {"type": "video_url", "video_url": {"url": data_url(data, container)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part
