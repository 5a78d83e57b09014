"""Frozen settings of one `epd bench` run, validated at construction.

The CLI (cli.py) parses flags into these; the runner, workloads and load
generator only read them. Parsers for the compact flag syntaxes
(`224x224:0.5,448x448:0.5`, `ttft:500 tpot:50`, `1,2,4`) live here too so the
Python API and the CLI accept the same strings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("random-mm", "text", "replay", "video")
IMAGE_FORMATS = ("jpeg", "png")
SLO_KEYS = ("ttft", "tpot", "e2el")


class BenchError(Exception):
    """A usage or setup error: printed as one line, exit status 2."""


@dataclass(frozen=True)
class ImageSize:
    width: int
    height: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1 or not self.weight > 0:
            raise BenchError(f"image size {self.width}x{self.height}:{self.weight}: sides and weight must be > 0")


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random-mm"
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    images_per_request: int = 1
    image_sizes: tuple[ImageSize, ...] = (ImageSize(224, 224),)
    image_pool: int = 0
    image_format: str = "jpeg"
    replay_file: str | None = None
    ignore_eos: bool = True
    seed: int = 0
    videos_per_request: int = 1
    video_frames: int = 8
    video_size: ImageSize = ImageSize(224, 224)
    video_fps: float = 2.0
    video_pool: int = 0
    video_overlap: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise BenchError(f"unknown workload {self.kind!r}; supported: {', '.join(WORKLOADS)}")
        if self.kind == "replay" and not self.replay_file:
            raise BenchError("workload replay needs --replay-file")
        if self.input_len < 1 or self.output_len < 1:
            raise BenchError("--input-len and --output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise BenchError("--range-ratio must be in [0, 1)")
        if self.images_per_request < 0 or self.image_pool < 0:
            raise BenchError("--images-per-request and --image-pool must be >= 0")
        if self.image_format not in IMAGE_FORMATS:
            raise BenchError(f"--image-format must be one of {', '.join(IMAGE_FORMATS)}")
        if not self.image_sizes:
            raise BenchError("--image-sizes needs at least one size")
        if self.videos_per_request < 0 or self.video_pool < 0 or self.video_frames < 1 or not self.video_fps > 0:
            raise BenchError("--videos-per-request and --video-pool must be >= 0, --video-frames >= 1, --video-fps > 0")
        if not 0.0 <= self.video_overlap < 1.0:
            raise BenchError("--video-overlap must be in [0, 1)")

    @property
    def num_images(self) -> int:
        """Images per request actually sent (text-only and video workloads send none)."""
        return self.images_per_request if self.kind == "random-mm" else 0

    @property
    def num_videos(self) -> int:
        return self.videos_per_request if self.kind == "video" else 0


@dataclass(frozen=True)
class LoadConfig:
    """How requests are issued. `concurrency` alone: a closed loop of N workers.
    `request_rate`: open-loop gamma arrivals, capped by `concurrency` when it is set too."""

    concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchError("--concurrency must be >= 1")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise BenchError("--request-rate and --burstiness must be > 0")
        if self.num_requests is None and self.duration_s is None:
            raise BenchError("give --num-requests or --duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchError("--num-requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise BenchError("--duration must be > 0")
        if self.warmup < 0 or not self.timeout_s > 0:
            raise BenchError("--warmup must be >= 0 and --timeout > 0")

    @property
    def is_open_loop(self) -> bool:
        return math.isfinite(self.request_rate)

    @property
    def max_in_flight(self) -> int | None:
        """The cap on requests in flight; None means unbounded (rate mode without a cap)."""
        if self.concurrency is not None:
            return self.concurrency
        return None if self.is_open_loop else 1


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; a request is "good" when it meets all that are set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def as_dict(self) -> dict[str, float]:
        pairs = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {k: v for k, v in pairs.items() if v is not None}


@dataclass(frozen=True)
class Endpoint:
    """One server under test: its chat URL, model (None: ask /v1/models), metrics URLs and
    fields merged into each of its request bodies (a None value removes the field)."""

    url: str
    model: str | None = None
    metrics_urls: tuple[str, ...] = ()
    label: str = "A"
    extra_body: dict[str, Any] = field(default_factory=dict)
    new_connection_per_request: bool = False   # a fresh HTTP connection for every request


@dataclass(frozen=True)
class BenchConfig:
    endpoints: tuple[Endpoint, ...]
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    slo: Slo = field(default_factory=Slo)
    sweep: tuple[int, ...] = ()
    round_size: int = 0
    calibrate: bool = False
    api_key: str | None = None
    show_progress: bool = True
    save_requests: bool = False
    seed_given: bool = True   # False: the seed was drawn at random for this run (the report says so)
    settle_s: float = 0.0     # compare: before each side's part of a round, wait up to this for quiet CPUs (quiet.py)

    def __post_init__(self) -> None:
        if len(self.endpoints) not in (1, 2):
            raise BenchError("give one endpoint, or two with --compare")
        if any(c < 1 for c in self.sweep):
            raise BenchError("--sweep levels must be >= 1")
        if self.round_size < 0:
            raise BenchError("--round-size must be >= 0")
        if not self.settle_s >= 0:
            raise BenchError("--settle-s must be >= 0")

    @property
    def is_compare(self) -> bool:
        return len(self.endpoints) == 2


def parse_image_sizes(text: str) -> tuple[ImageSize, ...]:
    """`224x224:0.5,448x448:0.5` -> sizes with weights (weight defaults to 1)."""
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        dims, _, weight = part.partition(":")
        width, sep, height = dims.lower().partition("x")
        try:
            sizes.append(ImageSize(int(width), int(height if sep else width), float(weight or 1.0)))
        except ValueError as exc:
            raise BenchError(f"bad image size {part!r}: expected WxH[:weight]") from exc
    return tuple(sizes)


def parse_slo(items: list[str] | tuple[str, ...]) -> Slo:
    """`["ttft:500", "tpot:50"]` (milliseconds) -> Slo."""
    values: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise BenchError(f"unknown SLO {key!r}; supported: {', '.join(SLO_KEYS)}")
        try:
            values[key + "_ms"] = float(value)
        except ValueError as exc:
            raise BenchError(f"bad SLO value in {item!r}: expected KEY:MILLISECONDS") from exc
    return Slo(**values)


def parse_int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise BenchError(f"bad list {text!r}: expected integers separated by commas") from exc


def parse_extra_body(text: str | None) -> dict[str, Any]:
    """`{"ignore_eos": null, "top_k": 1}` -> dict (null removes a field the workload sets)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchError(f"--extra-body: not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise BenchError("--extra-body must be a JSON object")
    return value
