"""Per-stage costs measured in process, with the roles' own code: the inputs of the capacity model.

- render: the render role's `render_chat` on a one-image request of 64 words (decoding, image
  processor, hashing, template, tokenizer);
- encode: one vision-tower forward of one image (`VisionModel.encode`, as the encode engine);
- prefill: one prompt of L tokens through `PrefillEngine.prefill`;
- decode: one `DecodeRunner.step` with B active rows at context C;
- bytes: pixel_values, embedding and KV sizes per image / token.

Costs are seconds of one process with the torch threads it was given (`threads`, default 1:
"core-seconds", which is what an instance count divides).  Each is the best of `repeats` runs
(as `timeit` advises): on a machine shared with other jobs the minimum is the estimate of the
stage's own cost, the rest is other people's load.  Rounds interleave all probes (`best_of_rounds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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


Probe = Callable[[], Any]


def best_of_rounds(probes: dict[tuple[str, Any], Probe], repeats: int) -> dict[tuple[str, Any], float]:
    """Best time of each probe over `repeats` rounds that call every probe once, after one warm-up
    round: each probe's samples are spread over the whole measurement, so a busy spell of other
    jobs cannot spoil all of one stage's samples."""
    for probe in probes.values():
        probe()
    best = {name: float("inf") for name in probes}
    for _ in range(repeats):
        for name, probe in probes.items():
            started = time.perf_counter()
            probe()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def _noise_image(width: int, height: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width * 7919 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def render_probe(service: Any, width: int, height: int) -> Probe:
    """The render role's whole job for a one-image chat request of 64 words: data-URL and JPEG
    decoding, the image processor, hashing, chat template and tokenizer (`RenderService.render_chat`)."""
    import asyncio
    import itertools
    import json

    from services.bench import WorkloadConfig
    from services.bench.config import ImageSize
    from services.bench.workloads import make_workload
    from services.protocol.openai import ChatCompletionRequest

    config = WorkloadConfig(input_len=64, image_sizes=(ImageSize(width, height),), seed=width)
    bodies = [json.loads(r.payload("bench")) for r in make_workload(config).build_many(0, 8)]
    requests = itertools.cycle([ChatCompletionRequest.model_validate(b) for b in bodies])
    return lambda: asyncio.run(service.render_chat(next(requests)))


def image_probes(costs: StageCosts, path: Any, sizes: list[tuple[int, int]]) -> dict[tuple[str, Any], Probe]:
    import torch

    from services.models.registry import adapter_for
    from services.render.processor import ImageProcessor
    from services.render.serving import RenderService

    processor = ImageProcessor(path)
    service = RenderService(path, "bench")
    vision = adapter_for(path).load_vision(path, "cpu", "float32")
    costs.embedding_bytes_per_token = vision.hidden_size * 4
    probes: dict[tuple[str, Any], Probe] = {}
    for width, height in sizes:
        key = f"{width}x{height}"
        processed = processor.process(_noise_image(width, height))
        item = {k: torch.from_numpy(v) for k, v in processed.arrays.items()}
        costs.image_tokens[key] = processed.num_tokens
        costs.pixel_bytes[key] = int(processed.arrays["pixel_values"].nbytes)
        probes[("render", key)] = render_probe(service, width, height)
        probes[("encode", key)] = lambda item=item: vision.encode([item])
    return probes


def language_probes(costs: StageCosts, path: Any, prompt_lens: list[int], batches: list[int], context: int
                    ) -> dict[tuple[str, Any], Probe]:
    import torch

    from services.decode.block_pool import BlockPool
    from services.decode.request_blocks import RequestBlocks
    from services.decode.runner import DecodeRunner
    from services.generation.params import DecodeParams
    from services.models.registry import adapter_for
    from services.prefill.engine import PrefillEngine
    from services.sampling.sampler import RowSampling, Sampler

    lm = adapter_for(path).load_language(path, "cpu", "float32", max(max(prompt_lens), context) + 64)
    layout = lm.layout
    costs.kv_bytes_per_token = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 4
    costs.decode_context = context
    engine = PrefillEngine(lm, prefix_cache_mb=0)   # every probe a full forward: a cache hit would time one block
    gen = torch.Generator().manual_seed(0)
    probes: dict[tuple[str, Any], Probe] = {}
    for length in prompt_lens:
        ids = torch.randint(0, 150000, (length,), generator=gen).tolist()
        probes[("prefill", length)] = lambda ids=ids: engine.prefill(ids)
    rows_max, per_row = max(batches), -(-(context + 8) // 16)
    from services.decode.block_pool import block_bytes

    pool = BlockPool(layout, rows_max * per_row * block_bytes(layout, 16), 16)
    runner = DecodeRunner(lm, pool, rows_max, context + 8, Sampler(0))
    kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, context, layout.head_dim, dtype=layout.dtype)
    seqs = []
    for row in range(rows_max):
        assert pool.try_reserve(per_row)
        seqs.append(RequestBlocks(pool, per_row))
        seqs[-1].load(kv)
        runner.place(row, seqs[-1])
    greedy = DecodeParams(temperature=0.0)

    def step(batch: int, rows: list[Any]) -> None:
        runner.step([100] * batch, [0] * batch, seqs[:batch], rows)
        for seq in seqs[:batch]:   # back to `context` tokens: every sample sees the same context
            seq.truncate(context)

    for batch in batches:
        rows = [RowSampling(greedy, ()) for _ in range(batch)]
        probes[("decode", batch)] = lambda b=batch, r=rows: step(b, r)
    return probes


def measure(model: str = "tiny", sizes: list[tuple[int, int]] | None = None, prompt_lens: list[int] | None = None,
            batches: list[int] | None = None, context: int = 256, repeats: int = 3, threads: int = 1) -> StageCosts:
    import torch

    from services.models.demo import demo_model_path

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        path = demo_model_path(model)
        costs = StageCosts(model, threads)
        probes = {**image_probes(costs, path, sizes or [(224, 224), (448, 448)]),
                  **language_probes(costs, path, prompt_lens or [128, 512], batches or [1, 4, 16], context)}
        tables = {"render": costs.render_s, "encode": costs.encode_s, "prefill": costs.prefill_s,
                  "decode": costs.decode_step_s}
        for (stage, key), seconds in best_of_rounds(probes, repeats).items():
            tables[stage][key] = seconds
        return costs
    finally:
        torch.set_num_threads(previous)
