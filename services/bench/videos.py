"""Seeded synthetic video clips as data URLs: the pool that controls reuse, and overlap between clips.

A *recording* is an endless, deterministic sequence of frames (a moving gradient under 8x8 blocks of
seeded noise).  Clip k of a run is frames [k * step, k * step + frames) of one recording, encoded as MP4
(H.264, every frame a key frame, a fixed quantiser), `fps` frames per second:

- `overlap` 0 (default): step = frames, so clips never share a frame;
- `overlap` o: step = frames minus o of them (rounded to whole frame groups of two frames), so each clip
  repeats the last o of the one before: a sliding window over a stream, cut at key frames.  Every frame is
  a key frame, so a frame decodes to the same pixels in every clip that holds it, and an encoder cache that
  keys frame groups by their pixels (epd's) finds the shared ones;
- `pool_size` N > 0: as for images (images.py), the first N clips in order, then clips drawn from the N.

At 2 fps (the default) vLLM's Qwen-VL sampling keeps every frame, so `frames` is what the model sees.
Every clip is a pure function of (seed, clip key): two runs, or the two endpoints of a compare run, send
byte-identical clips.
"""

from __future__ import annotations

import base64
import fractions
import io
import threading
from functools import lru_cache
from typing import cast

import numpy as np

_DRAW_STREAM = 4
INTRA_H264 = ("libx264", {"g": "1", "qp": "18", "bf": "0"})


@lru_cache(maxsize=2048)
def frame(recording: int, index: int, width: int, height: int) -> np.ndarray:
    """Frame `index` of a recording: [height, width, 3] uint8, read-only (clips of one recording share it)."""
    rng = np.random.default_rng([recording, index, width, height])
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 3 + index * 7) % 256, (y * 5 + index * 11) % 256, ((x + y) * 2 + recording * 29) % 256], -1)
    noise = rng.integers(-24, 25, size=(height // 8 + 1, width // 8 + 1, 3))
    noise = np.kron(noise, np.ones((8, 8, 1), dtype=np.int64))[:height, :width]
    out = np.clip(base + noise, 0, 255).astype(np.uint8)
    out.setflags(write=False)
    return out


def encode_clip(count: int, width: int, height: int, fps: float = 2.0, *, recording: int = 0, start: int = 0,
                codec: str = INTRA_H264[0], options: dict[str, str] | None = None, container: str = "mp4") -> bytes:
    """Frames [start, start + count) of `recording`, encoded at `fps` frames per second."""
    import av

    if options is None:
        options = dict(INTRA_H264[1]) if codec == INTRA_H264[0] else {}
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = cast("av.VideoStream", out.add_stream(codec, rate=fractions.Fraction(fps).limit_denominator(1001),
                                                       options=options))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(start, start + count):
            picture = av.VideoFrame.from_ndarray(frame(recording, index, width, height), format="rgb24")
            for packet in stream.encode(picture):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


class VideoFactory:
    """Clip key -> data URL (cached for pooled clips)."""

    def __init__(self, frames: int, width: int, height: int, fps: float, pool_size: int, overlap: float,
                 seed: int) -> None:
        self.frames, self.width, self.height, self.fps = frames, width, height, fps
        self.pool_size, self.seed = pool_size, seed
        shared = 2 * round(frames * overlap / 2)
        self.step = max(2, frames - shared)
        self._cache: dict[int, str] = {}
        self._lock = threading.Lock()

    def key_for(self, clip_index: int) -> int:
        if self.pool_size == 0 or clip_index < self.pool_size:
            return clip_index
        rng = np.random.default_rng([self.seed, _DRAW_STREAM, clip_index])
        return int(rng.integers(self.pool_size))

    def data_url(self, key: int) -> str:
        with self._lock:
            cached = self._cache.get(key)
        if cached is None:
            data = encode_clip(self.frames, self.width, self.height, self.fps, recording=self.seed,
                               start=key * self.step)
            cached = "data:video/mp4;base64," + base64.b64encode(data).decode("ascii")
            if self.pool_size:
                with self._lock:
                    self._cache[key] = cached
        return cached
