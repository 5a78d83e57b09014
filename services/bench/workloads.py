"""Workloads: request index -> chat completion request, deterministically.

`build(i)` is a pure function of the workload settings and i, so runs,
endpoints of a compare run and levels of a sweep can all rebuild or share the
exact same requests. Bodies are serialized once here, without the model name,
which the client splices in at send time (it is only known after /v1/models).

- random-mm: vLLM's random multimodal dataset: random words (about one token
  each) of a length drawn from input_len * [1 - range_ratio, 1 + range_ratio],
  the same for the output length (max_tokens, with ignore_eos), and
  `images_per_request` noise images from images.ImageFactory.
- text: the same without images.
- video: the same with `videos_per_request` clips (videos.py: a pool, and overlap between
  consecutive clips) instead of images.
- replay: chat request bodies, one JSON object per line, sent in file order
  (cycled when more requests are asked for); `model` is replaced and
  streaming with usage is switched on.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import BenchError, WorkloadConfig
from .images import ImageFactory
from .videos import VideoFactory

_WORDS = tuple(
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part "
    "over new sound take only little work know place year live me back give most very after thing our just name "
    "good sentence man think say great where help through much before line right too mean old any same tell boy "
    "follow came want show also around form three small set put end does another well large must big even such "
    "because turn here why ask went men read need land different home us move try kind hand picture again change "
    "off play spell air away animal house point page letter mother answer found study still learn should world".split()
)
_LENGTH_STREAM = 11
_TEXT_STREAM = 12


@dataclass(frozen=True)
class BenchRequest:
    """One request ready to send. `body` is the JSON body without "model"."""

    index: int
    body: bytes
    est_prompt_tokens: int
    image_ids: tuple[str, ...] = ()

    def payload(self, model: str, extra: dict[str, Any] | None = None) -> bytes:
        """The body with "model" and an endpoint's extra fields (they override; a None value removes)."""
        head = b'{"model":' + json.dumps(model).encode()
        data = head + (b"," + self.body[1:] if len(self.body) > 2 else b"}")
        if not extra:
            return data
        if any(v is None for v in extra.values()):  # removal needs a real parse; rare, so paid here
            body = {**json.loads(data), **extra}
            return _dumps({k: v for k, v in body.items() if v is not None})
        return data[:-1] + b"," + _dumps(extra)[1:]  # later keys win in every common JSON parser


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


class Workload(ABC):
    name: str

    @abstractmethod
    def build(self, index: int) -> BenchRequest:
        """The request at position `index` of the run (any index >= 0)."""

    def build_many(self, start: int, stop: int) -> list[BenchRequest]:
        return [self.build(i) for i in range(start, stop)]


class RandomWorkload(Workload):
    """random-mm and text."""

    def __init__(self, config: WorkloadConfig, seed_offset: int = 0) -> None:
        self.config = config
        self.name = config.kind
        self.seed = config.seed + seed_offset
        self.images = ImageFactory(config.image_sizes, config.image_pool, config.image_format, self.seed)
        size = config.video_size
        self.videos = VideoFactory(config.video_frames, size.width, size.height, config.video_fps, config.video_pool,
                                   config.video_overlap, self.seed)

    def _length(self, target: int, rng: np.random.Generator) -> int:
        low = max(1, int(target * (1 - self.config.range_ratio)))
        high = max(low, int(target * (1 + self.config.range_ratio)))
        return int(rng.integers(low, high + 1))

    def _text(self, index: int, num_words: int) -> str:
        rng = np.random.default_rng([self.seed, _TEXT_STREAM, index])
        picks = rng.integers(len(_WORDS), size=num_words)
        return " ".join(_WORDS[p] for p in picks)

    def build(self, index: int) -> BenchRequest:
        rng = np.random.default_rng([self.seed, _LENGTH_STREAM, index])
        num_words, max_tokens = self._length(self.config.input_len, rng), self._length(self.config.output_len, rng)
        text = self._text(index, num_words)
        count, videos = self.config.num_images, self.config.num_videos
        keys = [self.images.key_for(index * count + m) for m in range(count)]
        clips = [self.videos.key_for(index * videos + m) for m in range(videos)]
        content: Any = [{"type": "image_url", "image_url": {"url": self.images.data_url(k)}} for k in keys]
        content += [{"type": "video_url", "video_url": {"url": self.videos.data_url(k)}} for k in clips]
        content = [*content, {"type": "text", "text": text}] if content else text
        body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        ids = tuple(f"img-{k}" for k in keys) + tuple(f"vid-{k}" for k in clips)
        return BenchRequest(index, _dumps(body), num_words, ids)


class ReplayWorkload(Workload):
    name = "replay"

    def __init__(self, config: WorkloadConfig) -> None:
        assert config.replay_file is not None
        self.bodies = _read_jsonl(config.replay_file)

    def build(self, index: int) -> BenchRequest:
        body = dict(self.bodies[index % len(self.bodies)])
        body.pop("model", None)
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        words, urls = _scan_messages(body.get("messages", []))
        ids = tuple(hashlib.blake2b(u.encode(), digest_size=8).hexdigest() for u in urls)
        return BenchRequest(index, _dumps(body), words, ids)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    bodies = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                body = json.loads(line)
                if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                    raise BenchError(f"{path}:{number}: expected a chat request object with 'messages'")
                bodies.append(body)
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read replay file {path}: {exc}") from exc
    if not bodies:
        raise BenchError(f"replay file {path} holds no requests")
    return bodies


def _scan_messages(messages: list[Any]) -> tuple[int, list[str]]:
    """Word count (the prompt-token estimate when the server reports no usage) and image URLs."""
    words, urls = 0, []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else (content or [])
        for part in parts:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                words += len(str(part.get("text", "")).split())
            elif part.get("type") == "image_url":
                image = part.get("image_url")
                urls.append(str(image.get("url", "")) if isinstance(image, dict) else str(image))
    return words, urls


def make_workload(config: WorkloadConfig, seed_offset: int = 0) -> Workload:
    if config.kind == "replay":
        return ReplayWorkload(config)
    return RandomWorkload(config, seed_offset)
