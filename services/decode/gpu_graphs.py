"""The CUDA decode step per batch bucket: one CUDA graph each, captured at start-up, replayed per step.

Buckets are 1, 2, 4, ... up to the engine's rows, and the rows themselves (services/decode/compiled.py
`step_buckets`); a step of `count` rows replays the smallest bucket >= count, its rows count..bucket-1 padded
by the runner (token 0 at position 0, K/V written to and read from the pool's scratch block only, their
outputs dropped).  A graph launches the whole step (every layer's kernels, flex attention's included) in one
call and reads only the decoder's static buffers, so a step costs the host one replay and no synchronisation.

Capture, largest bucket first into one shared memory pool (the smaller graphs reuse the largest one's memory):
two warm-up forwards on a side stream per bucket (flex_attention compiles for the shape there; cuBLAS picks its
kernels), then the capture.  All warm-up and captured rows are padding, so capture writes nothing but the
scratch block.  Off CUDA (tests, the gpu_check dry run) nothing is captured and the same forward runs eagerly;
on CUDA a failed capture leaves the step eager, with the reason in the report and the start-up log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.decode.gpu_forward import GpuDecoder
from services.decode.runner import StepReport

logger = logging.getLogger(__name__)
MODE = "cuda-graphs"
WARMUPS = 2


class StepGraphs:
    def __init__(self, decoder: GpuDecoder, buckets: tuple[int, ...]) -> None:
        self.decoder, self.buckets = decoder, tuple(sorted(buckets))
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.replays = 0
        self.report = StepReport("eager", "not captured")
        self.capture_s: dict[int, float] = {}   # seconds each bucket's capture took

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, count: int) -> int:
        """The smallest bucket that holds `count` rows (the largest bucket is the engine's rows)."""
        for bucket in self.buckets:
            if bucket >= count:
                return bucket
        raise ValueError(f"a step of {count} rows is beyond the largest bucket {self.buckets[-1]}")

    def capture(self, pad_all: Callable[[int], None]) -> StepReport:
        """Capture every bucket (CUDA only); `pad_all(bucket)` makes the device buffers all padding rows."""
        if self.decoder.device.type != "cuda":
            self.report.reason = f"eager on {self.decoder.device} (CUDA graphs are CUDA's)"
            return self.report
        try:
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            for bucket in reversed(self.buckets):
                started = time.monotonic()
                self._graphs[bucket] = self._capture_one(bucket, pad_all, pool, side)
                self.capture_s[bucket] = time.monotonic() - started
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the step eager, said once
            self._graphs.clear()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.report.reason = f"capture failed ({type(exc).__name__}: {first[:200]}); eager"
            logger.error("decode CUDA graphs: %s", self.report.reason)
            self.capture_s.clear()
            return self.report
        timings = ", ".join(f"{b}: {t:.1f} s" for b, t in sorted(self.capture_s.items()))
        self.report = StepReport(MODE, f"captured buckets {timings}")
        return self.report

    def _capture_one(self, bucket: int, pad_all: Callable[[int], None], pool: Any, side: Any
                     ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        pad_all(bucket)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUPS):
                self.decoder.forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits, tokens = self.decoder.forward(bucket)
        return graph, logits, tokens

    def run(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, argmax) of the step over the buffers' first `bucket` rows: the graph's replay, else eager.
        A replay's outputs are the graph's own tensors, overwritten by the next replay of that bucket."""
        captured = self._graphs.get(bucket)
        if captured is None:
            return self.decoder.forward(bucket)
        graph, logits, tokens = captured
        graph.replay()
        self.replays += 1
        return logits, tokens


def step_buckets(max_rows: int, asked: Sequence[int] | None = None) -> tuple[int, ...]:
    """`asked` (sorted, each in 1..max_rows), or by default 1, 2, 4, ... below max_rows, then max_rows."""
    if asked:
        chosen = tuple(sorted(set(asked)))
        if chosen[0] < 1 or chosen[-1] > max_rows:
            raise ValueError(f"step buckets must be in 1..{max_rows} (the engine's rows), got {chosen}")
        return chosen
    found, size = [], 1
    while size < max_rows:
        found.append(size)
        size *= 2
    return (*found, max_rows)
