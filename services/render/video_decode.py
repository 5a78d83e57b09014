"""Decode untrusted video bytes with PyAV (FFmpeg), reading frames exactly as vLLM's OpenCV loader does.

vLLM (0.32) opens a video with OpenCV's FFmpeg backend and reads it as `VideoSourceMetadata`:
the frame count is the container's `nb_frames`, else round(duration * fps); fps is the stream's
`avg_frame_rate`, else 1 / time_base; duration is count / fps.  It then picks frame indices (the
family's sampling, video_sampling.py) and grabs frames one after the other up to the last index,
keeping the picked ones as RGB.  This module does the same with PyAV: the same counts (its demuxer
and decoder are FFmpeg's too), frames by sequential index, converted to rgb24 with swscale's bicubic
filter (OpenCV's flag).  tests/interop compares the frames and what they become with a real vLLM.

Threat model: the bytes are hostile.
- Only three container families are demuxed (MP4/MOV, Matroska/WebM, AVI), chosen by their magic
  bytes and named to FFmpeg, so its probe never runs the playlist demuxers (HLS, concat) that open
  further URLs or files; MOV's external data references stay off (FFmpeg's default).
- Frame size, duration and the number of frames to decode are checked from the headers before any
  frame is decoded; decoding stops at the last frame needed and at a deadline.
- Everything that fails is an `InvalidRequest` (400) naming the problem: `invalid_video` (corrupt,
  truncated, no video stream, no frame), `unsupported_video` (container or codec), `video_too_large`,
  `video_too_long`, `video_decode_timeout`.

Called by: the render worker processes (services/render/workers.py), through video_procs.py.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.protocol.errors import InvalidRequest

INVALID = "invalid_video"
UNSUPPORTED = "unsupported_video"
TOO_LARGE = "video_too_large"
TOO_LONG = "video_too_long"
TIMEOUT = "video_decode_timeout"
_MOV_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")


@dataclass(frozen=True)
class VideoBounds:
    """What a decode may cost: the render limits that apply before and while frames are decoded."""

    max_frame_pixels: int
    max_duration_s: float
    deadline_s: float


@dataclass(frozen=True)
class SourceInfo:
    """What vLLM's OpenCV loader reads from the headers (`VideoSourceMetadata`)."""

    total_frames: int
    fps: float
    width: int
    height: int
    codec: str

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps if self.fps > 0 else 0.0


def container_format(data: bytes) -> str:
    """The FFmpeg demuxer for `data`, from its magic bytes; 400 for anything else."""
    if data[4:8] in _MOV_BOXES:
        return "mov"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    raise InvalidRequest("video format is not supported (supported containers: MP4/MOV, WebM/Matroska, AVI)",
                         code=UNSUPPORTED)


class OpenVideo:
    """One opened video: its first video stream and header facts.  Use as a context manager."""

    def __init__(self, data: bytes, bounds: VideoBounds) -> None:
        import av

        if not data:
            raise InvalidRequest("video is empty", code=INVALID)
        self.bounds = bounds
        self.started = time.monotonic()
        try:
            self.container = av.open(io.BytesIO(data), format=container_format(data), mode="r")
        except av.FFmpegError as exc:
            raise InvalidRequest(f"video cannot be read: {_reason(exc)}", code=INVALID) from None
        try:
            if not self.container.streams.video:
                raise InvalidRequest("video has no video stream", code=INVALID)
            self.stream = self.container.streams.video[0]
            self.info = self._probe()
        except BaseException:
            self.container.close()
            raise

    def __enter__(self) -> OpenVideo:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.container.close()

    def _probe(self) -> SourceInfo:
        context = self.stream.codec_context
        if context is None or not context.name:
            raise InvalidRequest("video codec is not supported", code=UNSUPPORTED)
        width, height = int(context.width or 0), int(context.height or 0)
        if width <= 0 or height <= 0:
            raise InvalidRequest("video has no frame size in its header", code=INVALID)
        if width * height > self.bounds.max_frame_pixels:
            raise InvalidRequest(f"video frames of {width}x{height}={width * height} pixels > "
                                 f"max_video_frame_pixels={self.bounds.max_frame_pixels}", code=TOO_LARGE)
        fps = _fps(self.stream)
        total = self._visible(int(self.stream.frames or 0) or math.floor(self._duration_s() * fps + 0.5))
        if total <= 0:
            raise InvalidRequest("video has no frames", code=INVALID)
        info = SourceInfo(total, fps, width, height, context.name)
        if info.duration > self.bounds.max_duration_s:
            raise InvalidRequest(f"video lasts {info.duration:.1f} s > max_video_duration_s="
                                 f"{self.bounds.max_duration_s:g}", code=TOO_LONG)
        return info

    def _duration_s(self) -> float:
        """OpenCV's get_duration_sec: the container's duration, else the stream's."""
        if self.container.duration:
            return self.container.duration / 1_000_000
        stream = self.stream
        return float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0

    def _visible(self, total: int) -> int:
        """vLLM trusts the header's count unless a seek to the end shows fewer presentable frames (an MP4
        edit list hiding a lead-in): the same test here, counting the packets the demuxer does not discard."""
        if total <= 0 or self.container.format.name not in ("mov", "mov,mp4,m4a,3gp,3g2,mj2", "mp4"):
            return total
        try:
            visible = sum(1 for p in self.container.demux(self.stream) if p.size and not p.is_discard)
            self.container.seek(0, stream=self.stream)
        except Exception:  # noqa: BLE001 - the decode that follows reports a damaged file itself
            return total
        return visible if 0 < visible < total - 1 else total

    def read(self, indices: Sequence[int]) -> tuple[np.ndarray, list[int]]:
        """The frames at `indices` (sorted, by decode order) as [n, H, W, 3] uint8 RGB, and the indices found;
        frames the stream lacks are skipped, as vLLM's loader skips them."""
        import av

        wanted, last = set(indices), max(indices)
        frames: list[np.ndarray] = []
        found: list[int] = []
        try:
            for index, frame in enumerate(self.container.decode(self.stream)):
                self._check_deadline()
                if index in wanted:
                    frames.append(frame.to_ndarray(format="rgb24", interpolation="BICUBIC"))
                    found.append(index)
                if index >= last:
                    break
        except av.FFmpegError as exc:
            if not frames:
                raise InvalidRequest(f"video cannot be decoded: {_reason(exc)}", code=INVALID) from None
        if not frames:
            raise InvalidRequest("video has no decodable frame", code=INVALID)
        shapes = {f.shape for f in frames}
        if len(shapes) != 1:
            raise InvalidRequest(f"video changes frame size mid-stream ({sorted(shapes)})", code=UNSUPPORTED)
        return np.stack(frames), found

    def _check_deadline(self) -> None:
        if time.monotonic() - self.started > self.bounds.deadline_s:
            raise InvalidRequest(f"decoding the video took longer than video_decode_timeout_s="
                                 f"{self.bounds.deadline_s:g}", code=TIMEOUT)


def _fps(stream: Any) -> float:
    """OpenCV's CAP_PROP_FPS: the average frame rate, else 1 / the stream's time base."""
    rate = stream.average_rate
    if rate:
        return float(rate)
    base = stream.time_base
    return float(1 / base) if base else 0.0


def _reason(exc: Exception) -> str:
    """FFmpeg's own words for the failure (never the bytes or a path)."""
    text = getattr(exc, "strerror", None) or type(exc).__name__
    return str(text)[:200]
