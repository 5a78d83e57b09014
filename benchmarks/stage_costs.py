"""Per-stage costs measured in process, with the roles' own code: the inputs of the capacity model.

- render: the render role's `render_chat` on a one-image request of 64 words (decoding, image
  processor, hashing, template, tokenizer);
- encode: one vision-tower forward of one image (`VisionModel.encode`, as the encode engine);
- prefill: one prompt of L tokens through `PrefillEngine.prefill`;
- decode: one `DecodeRunner.step` with B active rows at context C;
- bytes: pixel_values, embedding and KV sizes per image / token.

Costs are seconds of one process with the torch threads it was given (`threads`, default 1:
"core-seconds", which is what an instance count divides).  Each is the median of `repeats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import median


@dataclass
class StageCosts:
    model: str
    threads: int
    render_s: dict[str, float] = field(default_factory=dict)         # "WxH" -> s per image
    encode_s: dict[str, float] = field(default_factory=dict)         # "WxH" -> s per image
    image_tokens: dict[str, int] = field(default_factory=dict)       # "WxH" -> placeholder tokens
    pixel_bytes: dict[str, int] = field(default_factory=dict)        # "WxH" -> kwargs pixel_values bytes
    prefill_s: dict[int, float] = field(default_factory=dict)        # prompt tokens -> s
    decode_step_s: dict[int, float] = field(default_factory=dict)    # batch rows -> s per step
    decode_context: int = 0
    embedding_bytes_per_token: int = 0
    kv_bytes_per_token: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: ({str(kk): vv for kk, vv in v.items()} if isinstance(v, dict) else v)
                for k, v in self.__dict__.items()}


def _median_s(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return median(samples)


def _noise_image(width: int, height: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width * 7919 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def render_seconds(path: Any, width: int, height: int, repeats: int) -> float:
    """The render role's whole job for a one-image chat request of 64 words: data-URL and JPEG
    decoding, the image processor, hashing, chat template and tokenizer (`RenderService.render_chat`)."""
    import asyncio
    import json

    from services.bench import WorkloadConfig
    from services.bench.config import ImageSize
    from services.bench.workloads import make_workload
    from services.protocol.openai import ChatCompletionRequest
    from services.render.serving import RenderService

    service = RenderService(path, "bench")
    config = WorkloadConfig(input_len=64, image_sizes=(ImageSize(width, height),), seed=width)
    bodies = [json.loads(r.payload("bench")) for r in make_workload(config).build_many(0, repeats + 1)]
    requests = iter([ChatCompletionRequest.model_validate(b) for b in bodies])
    return _median_s(lambda: asyncio.run(service.render_chat(next(requests))), repeats)


def measure_images(costs: StageCosts, path: Any, sizes: list[tuple[int, int]], repeats: int) -> None:
    import torch

    from services.models.registry import adapter_for
    from services.render.processor import ImageProcessor

    processor = ImageProcessor(path)
    vision = adapter_for(path).load_vision(path, "cpu", "float32")
    for width, height in sizes:
        key = f"{width}x{height}"
        image = _noise_image(width, height)
        processed = processor.process(image)
        item = {k: torch.from_numpy(v) for k, v in processed.arrays.items()}
        costs.render_s[key] = render_seconds(path, width, height, repeats)
        costs.encode_s[key] = _median_s(lambda: vision.encode([item]), repeats)
        costs.image_tokens[key] = processed.num_tokens
        costs.pixel_bytes[key] = int(processed.arrays["pixel_values"].nbytes)
        costs.embedding_bytes_per_token = vision.hidden_size * 4


def measure_language(costs: StageCosts, path: Any, prompt_lens: list[int], batches: list[int], context: int,
                     repeats: int) -> None:
    import torch

    from services.decode.runner import DecodeRunner
    from services.decode.sampler import RowSampling, Sampler
    from services.decode.params import DecodeParams
    from services.models.registry import adapter_for
    from services.prefill.engine import PrefillEngine

    lm = adapter_for(path).load_language(path, "cpu", "float32", max(max(prompt_lens), context) + 64)
    engine = PrefillEngine(lm)
    gen = torch.Generator().manual_seed(0)
    for length in prompt_lens:
        ids = torch.randint(0, 150000, (length,), generator=gen).tolist()
        costs.prefill_s[length] = _median_s(lambda: engine.prefill(ids), repeats)
    layout = lm.layout
    costs.kv_bytes_per_token = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 4
    costs.decode_context = context
    runner = DecodeRunner(lm, max(batches), context + 32 * repeats + 64, Sampler(0))
    kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, context, layout.head_dim, dtype=layout.dtype)
    for row in range(max(batches)):
        runner.load(row, kv)
    greedy = DecodeParams(temperature=0.0)
    for batch in batches:
        rows = [RowSampling(greedy, ()) for _ in range(batch)]
        costs.decode_step_s[batch] = _median_s(lambda: runner.step([100] * batch, [0] * batch, rows), repeats * 4)
        for row in range(batch):   # back to `context` tokens, so every batch size sees the same context
            runner.cache.lengths[row] = context


def measure(model: str = "tiny", sizes: list[tuple[int, int]] | None = None, prompt_lens: list[int] | None = None,
            batches: list[int] | None = None, context: int = 256, repeats: int = 3, threads: int = 1) -> StageCosts:
    import torch

    from services.models.demo import demo_model_path

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        path = demo_model_path(model)
        costs = StageCosts(model, threads)
        measure_images(costs, path, sizes or [(224, 224), (448, 448)], repeats)
        measure_language(costs, path, prompt_lens or [128, 512], batches or [1, 4, 16], context, repeats)
        return costs
    finally:
        torch.set_num_threads(previous)
