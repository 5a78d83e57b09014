"""Image and video decoding and processing on a pool of worker processes, behind a processed-item cache.

`ImageWorkers.process(key, data, kind)` turns one image's (or video's: kind "video",
services/render/video_processor.py) encoded bytes into its `ProcessedImage` (the processor arrays
and its placeholder count).  With
`num_workers >= 1` (render's default: `--render-workers`) the decode and the
processor run in that many spawned processes (image_procs.py: the bytes in and
the arrays out through shared memory), so several images and requests
preprocess at once and the render event loop never waits on them (nor on the
GIL they hold); with 0 they run on two threads in this process (tests, tools).
Workers import no torch (the same block render's main process has) and load
the checkpoint's image processor once, at start.

Errors a worker raises on purpose (a corrupt or oversized image) come back as
(message, code) and are raised here as the same InvalidRequest; a worker that
dies (OOM) fails its image with a 503 and a new process takes its place.  A video's
decode has a deadline (`VideoBounds.deadline_s`) the worker checks between frames, and
the worker itself is killed (and replaced) a second later if it has not answered.

The cache maps an image's content key (the mm_hash of its bytes, model and
processor settings: never a client uuid) to its ProcessedImage, bounded in
bytes (least recently used out first), so an image render has seen is neither
decoded nor processed again.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from services.models.base import RenderSpec
from services.protocol.errors import InvalidRequest
from services.render.image_decode import decode_image
from services.render.image_procs import WorkerProcesses
from services.render.media_policy import MediaPolicy
from services.render.processor import ImageProcessor, ProcessedImage
from services.render.video_processor import VideoProcessor

log = logging.getLogger(__name__)
CACHE = Counter("epd_render_processed_cache", "Images looked up in render's processed-item cache, by result "
                "(hit: not decoded nor processed again)", ["result"])
_worker: tuple[ImageProcessor, MediaPolicy, VideoProcessor | None] | None = None  # set once in each worker
KILL_GRACE_S = 1.0   # past a video's own decode deadline, its worker is killed


def _init_worker(model_path: str, spec: RenderSpec | None, policy: MediaPolicy,
                 video: VideoProcessor | None = None) -> None:
    global _worker
    from services.runtime.heap import keep_freed_memory

    keep_freed_memory()  # each image's arrays reuse the last one's pages (services/runtime/heap.py)
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # as in render's main process
    from services.runtime.role_main import NO_TORCH_MESSAGE  # ...and the same silence about it

    logging.getLogger("transformers").addFilter(lambda record: NO_TORCH_MESSAGE not in record.getMessage())
    _worker = (ImageProcessor(model_path, spec), policy, video)


def decode_and_process(data: bytes, kind: str = "image") -> tuple[str, Any]:
    """("ok", ProcessedImage) or ("invalid", (message, code)); runs in a worker (or a thread)."""
    assert _worker is not None, "worker not initialised"
    return _run(*_worker, data, kind)


def _run(processor: ImageProcessor, policy: MediaPolicy, video: VideoProcessor | None, data: bytes,
         kind: str = "image") -> tuple[str, Any]:
    try:
        if kind == "video":
            if video is None:
                raise InvalidRequest("this model does not accept videos", code="videos_not_supported")
            return "ok", video.process(data)
        return "ok", processor.process(decode_image(data, policy))
    except InvalidRequest as exc:  # sent back as plain values: exceptions with extra fields do not pickle
        return "invalid", (exc.message, exc.code)


class ProcessedCache:
    """content key -> ProcessedImage, bounded in bytes, least recently used evicted first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes_used = 0
        self._entries: OrderedDict[str, tuple[ProcessedImage, int]] = OrderedDict()

    def get(self, key: str) -> ProcessedImage | None:
        found = self._entries.get(key)
        CACHE.labels("hit" if found else "miss").inc()
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: str, processed: ProcessedImage) -> None:
        size = sum(a.nbytes for a in processed.arrays.values())
        if size > self.max_bytes:
            return
        self._drop(key)
        self._entries[key] = (processed, size)
        self.bytes_used += size
        while self.bytes_used > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes_used -= entry[1]

    def __len__(self) -> int:
        return len(self._entries)


class ImageWorkers:
    def __init__(self, model_path: str | Path, spec: RenderSpec | None, policy: MediaPolicy,
                 num_workers: int = 0, cache_bytes: int = 256 << 20, video: VideoProcessor | None = None) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = num_workers
        self.video = video
        self._args = (str(model_path), spec, policy, video)
        self.cache = ProcessedCache(cache_bytes)
        self._local = ImageProcessor(model_path, spec) if num_workers == 0 else None
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="render-proc") if num_workers == 0 else None
        # image bytes in and arrays out through shared memory, not pickled through pipes (image_procs.py)
        self._procs = (WorkerProcesses(num_workers, _init_worker, self._args, decode_and_process)
                       if num_workers else None)

    def worker_pids(self) -> list[int]:
        return self._procs.pids() if self._procs is not None else []

    def warm_up(self) -> None:
        """Start every worker now (each loads the image processor), not at the first request."""
        if self._procs is not None:
            self._procs.warm_up()

    async def process(self, key: str, data: bytes, kind: str = "image") -> ProcessedImage:
        """The processed image (or video) of `data`, from the cache when its content `key` was seen."""
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        if self._procs is not None:
            limit = self.video.bounds.deadline_s + KILL_GRACE_S if kind == "video" and self.video else None
            value = await self._procs.run(data, kind, limit)
        else:
            assert self._local is not None
            loop = asyncio.get_running_loop()
            status, result = await loop.run_in_executor(self._threads, _run, self._local, self._args[2],
                                                        self.video, data, kind)
            if status == "invalid":
                raise InvalidRequest(result[0], code=result[1])
            value = result
        self.cache.put(key, value)
        return value

    def close(self) -> None:
        if self._procs is not None:
            self._procs.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
