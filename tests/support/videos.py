"""Test videos, made on the spot with PyAV (never downloaded).

A *recording* is a deterministic sequence of frames (seeded noise over a moving gradient); `clip` encodes
frames [start, start + count) of one as a file.  The default codec is H.264 with every frame a key frame
and a fixed quantiser, so a frame decodes to the same pixels in every clip that holds it: two clips of
one recording that overlap share their frame groups (what the encoder's frame-group cache reuses), as
segments cut from a stream at key frames would.
"""

from __future__ import annotations

import base64
import io
from functools import lru_cache

import numpy as np

MIME = {"mp4": "video/mp4", "webm": "video/webm", "matroska": "video/x-matroska", "avi": "video/x-msvideo"}
INTRA_H264 = ("libx264", {"g": "1", "qp": "18", "bf": "0"})


@lru_cache(maxsize=4096)
def frame(recording: int, index: int, width: int, height: int) -> np.ndarray:
    """Frame `index` of a recording: [height, width, 3] uint8 (cached: clips of one recording share frames)."""
    rng = np.random.default_rng([recording, index, width, height])
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 3 + index * 7) % 256, (y * 5 + index * 11) % 256, ((x + y) * 2 + recording * 29) % 256], -1)
    noise = rng.integers(-24, 25, size=(height // 8 + 1, width // 8 + 1, 3))
    noise = np.kron(noise, np.ones((8, 8, 1), dtype=np.int64))[:height, :width]
    out = np.clip(base + noise, 0, 255).astype(np.uint8)
    out.setflags(write=False)
    return out


def clip(count: int = 8, width: int = 224, height: int = 224, fps: float = 4.0, *, recording: int = 0,
         start: int = 0, codec: str = INTRA_H264[0], options: dict[str, str] | None = None,
         container: str = "mp4") -> bytes:
    """Frames [start, start + count) of `recording`, encoded at `fps` frames per second."""
    import fractions

    import av

    if options is None:
        options = dict(INTRA_H264[1]) if codec == INTRA_H264[0] else {}
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fractions.Fraction(fps).limit_denominator(1001), options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(start, start + count):
            picture = av.VideoFrame.from_ndarray(frame(recording, index, width, height), format="rgb24")
            for packet in stream.encode(picture):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def data_url(data: bytes, container: str = "mp4") -> str:
    return f"data:{MIME[container]};base64," + base64.b64encode(data).decode()


def video_part(data: bytes, container: str = "mp4", uuid: str | None = None) -> dict:
    """An OpenAI chat content part (vLLM's shape)."""
    part: dict = {"type": "video_url", "video_url": {"url": data_url(data, container)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part
