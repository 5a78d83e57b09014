"""The render role's core: OpenAI requests -> placeholder-expanded token ids + multimodal items.

Transport-free: the HTTP router and the gRPC servicer parse, call one method
here and map `EpdError`s.  Render holds the tokenizer, chat template and HF
image processor, never model weights, and never imports torch.

Chat flow: model check -> normalise messages (chat.py) -> chat template
(text, one placeholder per image: ``<|vision_start|><|image_pad|><|vision_end|>``
for Qwen-VL, ``<image>`` for LLaVA; ``<|video_pad|>`` per video) and, concurrently, media
fetch -> per-item decoding, processing and mm_hash on the workers -> tokenize -> expand
each placeholder for its item -> context-length check.  The result token
ids equal the family's HF processor's.  What a family's placeholders and
metadata are comes from its adapter's `RenderSpec` (services.models); a
text-only model has no image processor and answers 400 to any image.

Concurrency: tokenizer calls go through a one-thread executor (HF fast
tokenizers are not safe to call concurrently); image decoding and processing
run on `num_workers` worker processes (0: two threads here) behind a
processed-item cache of `cache_mb` keyed by content hash (services/render/workers.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.models.base import RenderSpec
from services.models.context import declared_context
from services.models.processing import load_tokenizer
from services.observability.activity import span
from services.protocol.common import fresh_id
from services.protocol.errors import InvalidRequest, NotFound
from services.protocol.features import ContentPart
from services.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.protocol.parsing import validate_model
from services.protocol.sampling import SamplingParams
from services.render.chat import PART_MODALITY, MediaRef, NormalizedChat, normalize_messages
from services.render.features import RenderedItem
from services.render.limits import RenderLimits, check_context_length
from services.render.media_policy import MediaPolicy
from services.render.multimodal import ImagePipeline, run_in
from services.render.placeholders import VisionTokens, fit_runs
from services.render.processor import ImageProcessor
from services.render.prompt import RenderedPrompt
from services.render.qwen_video import QwenVideoSettings
from services.render.template import ChatTemplate
from services.render.text_bound import check_text_fits, longest_token_bytes, message_texts, needs_count
from services.render.video_decode import VideoBounds
from services.render.video_processor import VideoProcessor
from services.render.workers import ImageWorkers

__all__ = ["RenderLimits", "RenderService", "RenderedItem", "RenderedPrompt"]


class RenderService:
    """One per render process; safe to call from many concurrent requests."""

    def __init__(self, model_path: str | Path, model_id: str, media_policy: MediaPolicy | None = None,
                 limits: RenderLimits | None = None, *, aliases: Sequence[str] = (),
                 metadata_keys: Sequence[str] | None = None, num_workers: int = 0,
                 spec: RenderSpec | None = None, cache_mb: int = 256, dtype: str = "float32") -> None:
        self.model_path = Path(model_path)
        self.model_id = model_id
        self.served_model_names = (model_id, *aliases)
        self.limits = limits or RenderLimits()
        self.spec = spec or _render_spec(model_path)
        self.metadata_keys = tuple(self.spec.metadata_keys if metadata_keys is None else metadata_keys)
        self.tokenizer = load_tokenizer(model_path)
        self.template = ChatTemplate(self.tokenizer, text_only=not self.spec.accepts_images)
        self.vision = _vision_tokens(self.tokenizer, self.spec)
        self.max_model_len = _context_length(self.limits.max_model_len, model_path, self.tokenizer)
        self.vocab_size = max(len(self.tokenizer), _checkpoint_vocab(model_path))
        self.longest_token = longest_token_bytes(self.tokenizer.get_vocab())
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="render-tok")
        self.workers: ImageWorkers | None = None
        self.images: ImagePipeline | None = None
        if self.vision is not None:
            policy = media_policy or MediaPolicy()
            video = _video_processor(model_path, self.spec, self.limits, self.max_model_len) \
                if self.vision.video_pad_id else None
            self.workers = ImageWorkers(model_path, self.spec, policy, num_workers, cache_mb << 20, video)
            self.images = ImagePipeline(ImageProcessor(model_path, self.spec), policy, self.limits, model_id,
                                        self.workers, hash_model_id=str(model_path), tokenize=self._encode_texts,
                                        dtype=dtype)

    # ---- public API -------------------------------------------------------------------------------

    async def render_chat(self, req: ChatCompletionRequest, request_id: str | None = None) -> RenderedPrompt:
        """One chat request -> one prompt (token ids, items, sampling)."""
        self.check_model(req.model)
        sampling = req.to_sampling_params()
        chat = normalize_messages(req.messages)
        await self._check_text(message_texts(chat.messages))
        with span("render"):  # the opt-in activity log (pipeline-overlap plot); a no-op otherwise
            text, token_ids, items = await self._render_messages(chat, req)
        check_context_length(len(token_ids), sampling.max_tokens, self.max_model_len)
        return self._prompt(req, request_id, token_ids, items, sampling, text)

    async def render_completion(self, req: CompletionRequest,
                                request_id: str | None = None) -> list[RenderedPrompt]:
        """One completion request -> one text-only prompt per entry of `prompt`."""
        self.check_model(req.model)
        sampling = req.to_sampling_params()
        base_id = request_id or fresh_id()
        prompts = req.prompts()
        out = []
        for index, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else None
            token_ids = await self._completion_ids(prompt)
            check_context_length(len(token_ids), sampling.max_tokens, self.max_model_len)
            rid = base_id if len(prompts) == 1 else f"{base_id}-{index}"
            out.append(self._prompt(req, rid, token_ids, [], sampling.model_copy(), text))
        return out

    async def render_content_parts(
        self, token_ids: Sequence[int], content_parts: Sequence[ContentPart | dict[str, Any]], *,
        request_id: str | None = None, model: str | None = None,
        sampling_params: SamplingParams | None = None, cache_salt: str | None = None,
    ) -> RenderedPrompt:
        """Token ids that already hold one placeholder run per part (length 1 or exact) + raw media."""
        self.check_model(model)
        refs = [_media_ref(index, part) for index, part in enumerate(content_parts)]
        self._check_ids(token_ids)
        if self.images is None or self.vision is None:
            self._refuse_media(refs)
            ids, items = list(token_ids), []  # type: tuple[list[int], list[RenderedItem]]
        else:
            ready = await self.images.process(await self.images.load(refs), cache_salt)
            ids, items = self.images.place(token_ids, ready, self.vision, self.metadata_keys)
        sampling = sampling_params or SamplingParams()
        check_context_length(len(ids), sampling.max_tokens, self.max_model_len)
        return RenderedPrompt(request_id or fresh_id(), ids, items, sampling, self.model_id, cache_salt)

    async def tokenize(self, *, prompt: str | None = None, messages: Sequence[Any] | None = None,
                       add_special_tokens: bool | None = None, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """vLLM /tokenize: a text prompt, or chat messages (images fetched, placeholders expanded)."""
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", code="invalid_tokenize_request")
        if prompt is not None:
            return await self._encode(prompt, add_special_tokens=add_special_tokens is not False)
        req = validate_model(ChatCompletionRequest, {
            "messages": list(messages or []), "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs})
        _, token_ids, _ = await self._render_messages(normalize_messages(req.messages), req,
                                                      add_special_tokens=bool(add_special_tokens))
        return token_ids

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self._check_ids(token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def check_model(self, model: str | None) -> None:
        """None passes; otherwise the served id or one of its aliases."""
        if model is not None and model not in self.served_model_names:
            served = ", ".join(self.served_model_names)
            raise NotFound(f"The model `{model}` does not exist (served: {served})",
                                 code="model_not_found")

    def close(self) -> None:
        """Stop the workers (queued work is cancelled)."""
        if self.workers is not None:
            self.workers.close()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals --------------------------------------------------------------------------------

    async def _render_messages(self, chat: NormalizedChat, req: ChatCompletionRequest,
                               add_special_tokens: bool = False) -> tuple[str, list[int], list[RenderedItem]]:
        self.limits.check_image_count(chat.count("image"))  # before any work is started
        self.limits.check_video_count(chat.count("video"))
        if self.images is None or self.vision is None:
            self._refuse_media(chat.media)
            text, ids = await run_in(self._tok_pool, self.template.render_and_encode, chat.messages, req,
                                     add_special_tokens)
            return text, ids, []
        # Template + tokenize run while the images are fetched.
        text_task = asyncio.ensure_future(run_in(self._tok_pool, self.template.render_and_encode,
                                                 chat.messages, req, add_special_tokens))
        try:
            loaded = await self.images.load(chat.media)
        except BaseException:
            text_task.cancel()
            raise
        text, ids = await text_task
        ready = await self.images.process(loaded, req.cache_salt)
        token_ids, items = self.images.place(ids, ready, self.vision, self.metadata_keys)
        return text, token_ids, items

    async def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            await self._check_text([prompt])
        ids = await self._encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        self._check_ids(ids)
        if self.vision is None:
            return ids
        token_ids, _ = fit_runs(ids, self.vision, [])  # media need a chat or content_parts
        return token_ids

    async def _check_text(self, texts: list[str]) -> None:
        """400 at once for text that cannot fit the context (text_bound.py), before tokenizing all of it."""
        count = self.template.encode
        if not needs_count(texts, self.max_model_len):  # short: decided without tokenizing, no thread hop
            return
        await run_in(self._tok_pool, check_text_fits, texts, self.max_model_len, self.longest_token,
                     lambda t: len(count(t)))

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await run_in(self._tok_pool, self.template.encode, text, add_special_tokens)

    async def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Text fragments spliced between special tokens (Qwen3-VL's frame timestamps), on the tokenizer thread."""
        return await run_in(self._tok_pool, lambda: [self.template.encode(t, False) for t in texts])

    def _refuse_media(self, refs: Sequence[MediaRef]) -> None:
        modalities = sorted({ref.modality for ref in refs})
        if modalities:
            kinds = " or ".join(f"{m}s" for m in modalities)
            raise InvalidRequest(f"model {self.model_id} does not accept {kinds}",
                                 code="images_not_supported" if "image" in modalities else "videos_not_supported")

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise InvalidRequest("the prompt is empty", code="empty_prompt")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of range [0, {self.vocab_size})",
                                 code="invalid_token_id")

    def _prompt(self, req: ChatCompletionRequest | CompletionRequest, request_id: str | None,
                token_ids: list[int], items: list[RenderedItem], sampling: SamplingParams,
                text: str | None) -> RenderedPrompt:
        return RenderedPrompt(
            request_id or fresh_id(), token_ids, items, self._as_vllm_renders(sampling, len(token_ids), req.stream),
            self.model_id, req.cache_salt, text, priority=req.priority, stream=req.stream,
            stream_options=req.stream_options if req.stream else None, kv_transfer_params=req.kv_transfer_params)

    def _as_vllm_renders(self, sampling: SamplingParams, num_prompt_tokens: int, stream: bool) -> SamplingParams:
        """What vLLM's render writes: an explicit max_tokens (the rest of the context when the request has
        none) and its bookkeeping fields (output_kind 1 = delta when streaming, else 2 = final only)."""
        max_tokens = sampling.max_tokens or self.max_model_len - num_prompt_tokens
        return sampling.model_copy(update={"max_tokens": max_tokens, "output_kind": 1 if stream else 2,
                                           "skip_clone": True, "skip_reading_prefix_cache": False})


def _media_ref(index: int, part: ContentPart | dict[str, Any]) -> MediaRef:
    parsed = part if isinstance(part, ContentPart) else validate_model(ContentPart, part)
    if parsed.type not in PART_MODALITY:
        raise InvalidRequest(f"content_parts[{index}]: modality {parsed.modality!r} is not supported "
                             "(supported: image, video)", code="unsupported_modality")
    return MediaRef(parsed.url, parsed.uuid, PART_MODALITY[parsed.type])


def _video_processor(model_path: str | Path, spec: RenderSpec, limits: RenderLimits,
                     max_tokens: int | None = None) -> VideoProcessor | None:
    """The checkpoint's video processing (Qwen-VL families), bounded by the render limits."""
    settings = QwenVideoSettings.from_checkpoint(model_path, spec.family)
    if settings is None or not limits.max_videos_per_request:
        return None
    bounds = VideoBounds(limits.max_video_frame_pixels, limits.max_video_duration_s, limits.video_decode_timeout_s)
    return VideoProcessor(settings, bounds, limits.max_video_frames, str(model_path), max_tokens)


def _render_spec(model_path: str | Path) -> RenderSpec:
    from services.models.registry import adapter_for

    return adapter_for(model_path).render_spec(model_path)


def _vision_tokens(tokenizer: Any, spec: RenderSpec) -> VisionTokens | None:
    """The family's placeholder ids, checked against the tokenizer; None for a text-only model."""
    if spec.image_token_id is None:
        return None
    ids = [spec.start_token_id, spec.image_token_id, spec.end_token_id, spec.video_token_id]
    names = tokenizer.convert_ids_to_tokens([i for i in ids if i is not None])
    if any(name is None or name == tokenizer.unk_token for name in names):
        raise ValueError(f"tokenizer lacks the {spec.family} placeholder tokens {ids}")
    return VisionTokens(spec.start_token_id, spec.image_token_id, spec.end_token_id, spec.video_token_id)


def _read_config(model_path: str | Path) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _context_length(configured: int | None, model_path: str | Path, tokenizer: Any) -> int:
    """The context render enforces and reports: the configured one, never beyond the checkpoint's (its
    config.json's, else its tokenizer's model_max_length).

    (/v1/models and /tokenize said 8192 for a 4096-position checkpoint; vLLM reports the checkpoint's.)
    """
    declared = declared_context(model_path)
    limit = getattr(tokenizer, "model_max_length", None)
    if declared is None and isinstance(limit, int) and 1 < limit < 10**9:
        declared = limit
    if declared is not None:
        return declared if configured is None else min(configured, declared)
    if configured is None:
        raise ValueError(f"cannot tell the context length of {model_path}: set RenderLimits.max_model_len")
    return configured


def _checkpoint_vocab(model_path: str | Path) -> int:
    config = _read_config(model_path)
    for source in (config.get("text_config") or {}, config):
        if isinstance(source.get("vocab_size"), int):
            return source["vocab_size"]
    return 0
