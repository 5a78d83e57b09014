"""Images and videos of one prompt: fetch, process + hash, and place into the token ids.

The three stages every input path shares (chat messages, content_parts):

1. `load` fetches all media concurrently under the media policy, tightened to the render limits
   (an image's size is read from its header here, so oversize media is refused before decoding; a
   video's headers are checked by the worker that decodes it); any failure cancels the other fetches
   and names the item ("image 1: ...", "video 0: ...").
2. `process` decodes and processes each item on render's workers (services/render/workers.py) behind
   the processed-item cache, keyed by the hash of the bytes; an image's mm_hash is that hash, a video's
   comes back from its worker (vLLM's, over the sampled frames' metadata: services.render.hashing).
   An item with a client uuid is named by uuid_scope (model, cache_salt, uuid).
3. `place` expands each placeholder to its item's tokens (placeholders.py) and builds the items.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from services.protocol.errors import InvalidRequest
from services.render.chat import MediaRef
from services.render.features import RenderedItem, rendered_item
from services.render.hashing import mm_hash
from services.render.image_decode import image_size
from services.render.limits import RenderLimits
from services.render.media_fetch import fetch_media
from services.render.media_policy import MediaPolicy
from services.render.placeholders import Expansion, VisionTokens, fit_runs
from services.render.processor import ImageProcessor, ProcessedImage
from services.render.uuid_scope import scoped_uuid
from services.render.workers import ImageWorkers

T = TypeVar("T")
# Media error code -> (render limit, the policy field it tightens).
_SIZE_CODES = {"image_too_large": ("max_image_pixels", "max_image_pixels"),
               "media_too_large": ("max_image_bytes", "max_bytes")}
Tokenize = Callable[[list[str]], Awaitable[list[list[int]]]]


@dataclass(frozen=True)
class LoadedImage:
    ref: MediaRef
    width: int
    height: int
    data: bytes           # the original encoded bytes: what mm_hash covers (decoded by a worker)


@dataclass(frozen=True)
class ReadyImage:
    processed: ProcessedImage
    mm_hash: str
    modality: str = "image"
    timestamp_ids: tuple[tuple[int, ...], ...] = ()   # Qwen3-VL: each frame group's "<t seconds>" tokens


class ImagePipeline:
    """Per-service image and video handling; holds no per-request state."""

    def __init__(self, processor: ImageProcessor, policy: MediaPolicy, limits: RenderLimits,
                 model_id: str, workers: ImageWorkers, hash_model_id: str | None = None,
                 tokenize: Tokenize | None = None, dtype: str = "float32") -> None:
        self.processor = processor
        self.limits = limits
        self.model_id = model_id  # the served name: scopes client uuids (uuid_scope)
        self.hash_model_id = hash_model_id or model_id  # vLLM's model_id in mm_hash: the model as given
        self.workers = workers
        self.tokenize = tokenize  # text -> ids on render's tokenizer thread (Qwen3-VL timestamps)
        self.dtype = dtype        # the model dtype: what vLLM writes float metadata in
        self.policy = dataclasses.replace(
            policy, max_bytes=min(policy.max_bytes, limits.max_image_bytes),
            max_image_pixels=min(policy.max_image_pixels, limits.max_image_pixels))
        self.video_policy = dataclasses.replace(policy, max_bytes=limits.max_video_bytes)

    async def load(self, refs: Sequence[MediaRef]) -> list[LoadedImage]:
        self.limits.check_image_count(sum(1 for r in refs if r.modality == "image"))
        self.limits.check_video_count(sum(1 for r in refs if r.modality == "video"))
        if self.workers.video is None and any(r.modality == "video" for r in refs):
            raise InvalidRequest(f"model {self.model_id} does not accept videos", code="videos_not_supported")
        indexed = _indexed(refs)
        return await gather_or_cancel([self._load_one(i, ref) for i, ref in indexed])

    async def process(self, images: Sequence[LoadedImage], cache_salt: str | None = None) -> list[ReadyImage]:
        """Processed items with their mm_hash (a client uuid is scoped by model and cache_salt)."""
        indexed = _indexed([image.ref for image in images])
        return await gather_or_cancel([self._process_one(i, image, cache_salt)
                                       for (i, _), image in zip(indexed, images, strict=True)])

    def place(self, token_ids: Sequence[int], ready: Sequence[ReadyImage], vision: VisionTokens,
              metadata_keys: Sequence[str]) -> tuple[list[int], list[RenderedItem]]:
        """Token ids with each placeholder expanded for its item, and one item per image or video."""
        ids, runs = fit_runs(token_ids, vision, [self._expansion(r, vision) for r in ready])
        queues = {m: iter([r for r in ready if r.modality == m]) for m in ("image", "video")}
        items = []
        for run in runs:
            r = next(queues[run.modality])
            items.append(rendered_item(run.modality, r.mm_hash, run.offset, run.length, r.processed.arrays,
                                       metadata_keys, self.dtype))
        return ids, items

    def _expansion(self, ready: ReadyImage, vision: VisionTokens) -> Expansion:
        if ready.modality == "image":
            return Expansion.pads("image", vision.pad_id, ready.processed.num_tokens)
        if vision.video_pad_id is None:
            raise InvalidRequest(f"model {self.model_id} does not accept videos", code="videos_not_supported")
        if not ready.timestamp_ids:
            return Expansion.pads("video", vision.video_pad_id, ready.processed.num_tokens)
        per_group = ready.processed.num_tokens // len(ready.timestamp_ids)
        tokens: list[int] = []
        for stamp in ready.timestamp_ids:   # Qwen3VLProcessor.replace_video_token, as token ids
            tokens += [*stamp, vision.start_id, *([vision.video_pad_id] * per_group), vision.end_id]  # type: ignore[list-item]
        return Expansion("video", tuple(tokens))

    async def _load_one(self, index: int, ref: MediaRef) -> LoadedImage:
        try:
            if ref.modality == "video":
                data = await fetch_media(ref.url, self.video_policy)
                return LoadedImage(ref, 0, 0, data)
            # No shared session: media opens (and closes) one per fetch, so nothing outlives an event loop.
            data = await fetch_media(ref.url, self.policy)
            width, height = image_size(data, self.policy)
            self.limits.check_image(width, height, len(data))
        except InvalidRequest as exc:
            raise self._named(index, ref.modality, exc) from None
        return LoadedImage(ref, width, height, data)

    async def _process_one(self, index: int, image: LoadedImage, cache_salt: str | None) -> ReadyImage:
        modality = image.ref.modality
        content = await asyncio.to_thread(mm_hash, modality, image.data, self.hash_model_id)
        try:
            processed = await self.workers.process(content, image.data, modality)
        except InvalidRequest as exc:
            raise self._named(index, modality, exc) from None
        uuid = scoped_uuid(self.model_id, cache_salt, image.ref.uuid) if image.ref.uuid else None
        stamps: tuple[tuple[int, ...], ...] = ()
        if processed.info.get("timestamps") and self.tokenize is not None:
            texts = [f"<{t:.1f} seconds>" for t in processed.info["timestamps"]]
            stamps = tuple(tuple(ids) for ids in await self.tokenize(texts))
        return ReadyImage(processed, uuid or processed.info.get("mm_hash", content), modality, stamps)

    def _named(self, index: int, modality: str, exc: InvalidRequest) -> InvalidRequest:
        """The error prefixed with the item ("video 0: ..."), naming the render limit that refused it."""
        message = f"{modality} {index}: {exc.message}"
        knob, value = self._binding_limit(modality, exc.code)
        if knob and knob not in message:
            message += f" (render limit {knob}={value})"
        return InvalidRequest(message, code=exc.code)

    def _binding_limit(self, modality: str, code: str) -> tuple[str, object]:
        if modality == "video":
            return ("max_video_bytes", self.limits.max_video_bytes) if code == "media_too_large" else ("", None)
        knob, policy_field = _SIZE_CODES.get(code, ("", ""))
        value = getattr(self.limits, knob, None)
        return (knob, value) if knob and value == getattr(self.policy, policy_field) else ("", None)


def _indexed(refs: Sequence[MediaRef]) -> list[tuple[int, MediaRef]]:
    """Each item's index among those of its modality ("image 1", "video 0")."""
    counts: dict[str, int] = {}
    out = []
    for ref in refs:
        counts[ref.modality] = counts.get(ref.modality, -1) + 1
        out.append((counts[ref.modality], ref))
    return out


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
