"""Images of one prompt: fetch + decode, process + hash, and place into the token ids.

The three stages every input path shares (chat messages, content_parts):

1. `load` fetches and decodes all images concurrently under the media policy,
   tightened to the render limits so oversize media is refused before it is
   decoded; any failure cancels the other fetches and names the image index.
2. `process` runs the HF image processor and the mm_hash of each image in the
   bounded thread pool (both are CPU-heavy; the event loop never blocks); an
   image with a client uuid is named by uuid_scope (model, cache_salt, uuid).
3. `place` sizes each image's placeholder run and builds the items.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from services.protocol.errors import InvalidRequest
from services.render.chat import ImageRef
from services.render.features import IMAGE, RenderedItem, rendered_item
from services.render.hashing import mm_hash
from services.render.image_decode import image_size
from services.render.limits import RenderLimits
from services.render.media import MediaPolicy
from services.render.media_fetch import fetch_media
from services.render.placeholders import VisionTokens, fit_runs
from services.render.processor import ImageProcessor, ProcessedImage
from services.render.uuid_scope import scoped_uuid
from services.render.workers import ImageWorkers

T = TypeVar("T")
# Media error code -> (render limit, the policy field it tightens).
_SIZE_CODES = {"image_too_large": ("max_image_pixels", "max_image_pixels"),
               "media_too_large": ("max_image_bytes", "max_bytes")}


@dataclass(frozen=True)
class LoadedImage:
    ref: ImageRef
    width: int
    height: int
    data: bytes           # the original encoded bytes: what mm_hash covers (decoded by a worker)


@dataclass(frozen=True)
class ReadyImage:
    processed: ProcessedImage
    mm_hash: str


class ImagePipeline:
    """Per-service image handling; holds no per-request state."""

    def __init__(self, processor: ImageProcessor, policy: MediaPolicy, limits: RenderLimits,
                 model_id: str, workers: ImageWorkers, hash_model_id: str | None = None) -> None:
        self.processor = processor
        self.limits = limits
        self.model_id = model_id  # the served name: scopes client uuids (uuid_scope)
        self.hash_model_id = hash_model_id or model_id  # vLLM's model_id in mm_hash: the model as given
        self.workers = workers
        self.policy = dataclasses.replace(
            policy, max_bytes=min(policy.max_bytes, limits.max_image_bytes),
            max_image_pixels=min(policy.max_image_pixels, limits.max_image_pixels))

    async def load(self, refs: Sequence[ImageRef]) -> list[LoadedImage]:
        self.limits.check_image_count(len(refs))
        return await gather_or_cancel([self._load_one(i, ref) for i, ref in enumerate(refs)])

    async def process(self, images: Sequence[LoadedImage], cache_salt: str | None = None) -> list[ReadyImage]:
        """Processed images with their mm_hash (a client uuid is scoped by model and cache_salt)."""
        return await gather_or_cancel([self._process_one(i, image, cache_salt) for i, image in enumerate(images)])

    def place(self, token_ids: Sequence[int], ready: Sequence[ReadyImage], vision: VisionTokens,
              metadata_keys: Sequence[str]) -> tuple[list[int], list[RenderedItem]]:
        """Token ids with each image's run sized to its token count, and one item per image."""
        ids, runs = fit_runs(token_ids, vision, [r.processed.num_tokens for r in ready])
        items = [rendered_item(IMAGE, r.mm_hash, run.offset, run.length, r.processed.arrays, metadata_keys)
                 for r, run in zip(ready, runs, strict=True)]
        return ids, items

    async def _load_one(self, index: int, ref: ImageRef) -> LoadedImage:
        try:
            # No shared session: media opens (and closes) one per fetch, so nothing outlives an event loop.
            data = await fetch_media(ref.url, self.policy)
            width, height = image_size(data, self.policy)
            self.limits.check_image(width, height, len(data))
        except InvalidRequest as exc:
            raise self._named(index, exc) from None
        return LoadedImage(ref, width, height, data)

    async def _process_one(self, index: int, image: LoadedImage, cache_salt: str | None) -> ReadyImage:
        content = await asyncio.to_thread(mm_hash, IMAGE, image.data, self.hash_model_id)
        try:
            processed = await self.workers.process(content, image.data)
        except InvalidRequest as exc:
            raise self._named(index, exc) from None
        uuid = scoped_uuid(self.model_id, cache_salt, image.ref.uuid) if image.ref.uuid else None
        return ReadyImage(processed, uuid or content)

    def _named(self, index: int, exc: InvalidRequest) -> InvalidRequest:
        message = f"image {index}: {exc.message}"
        knob, policy_field = _SIZE_CODES.get(exc.code, ("", ""))
        value = getattr(self.limits, knob, None)
        if knob and knob not in message and value == getattr(self.policy, policy_field):
            message += f" (render limit {knob}={value})"
        return InvalidRequest(message, code=exc.code)


async def gather_or_cancel(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """asyncio.gather that cancels the siblings when one fails (no orphan fetches)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def run_in(executor: Executor, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
    return asyncio.get_running_loop().run_in_executor(executor, fn, *args)
