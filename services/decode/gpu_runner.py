"""The decode engine's runner on CUDA: the step on device buffers, a CUDA graph per batch bucket, no host wait
but the sampled tokens.

The same interface as the CPU runner (services/decode/runner.py), which the engine picks by device
(services/decode/runners.py).  Per step the host does O(rows) bookkeeping into page-locked buffers (each row's
new token, position, K/V slot and length; a block table row when it gains a block or moves), sends them in
three asynchronous copies, and replays the bucket's graph (services/decode/gpu_graphs.py): embedding, every
layer with flex paged attention over the pool (services/decode/gpu_forward.py, flex_paged.py), the LM head and
the argmax.  Plain greedy rows take that argmax; the one synchronisation of a step is reading those tokens back.
Rows that sample, or ask for logprobs, penalties or min_tokens, go through the shared sampler on a copy of their
logits (float32, on the GPU), as on CPU.

The host buffers are rewritten only after the previous step's tokens came back, so its copies have completed.
CPU-only machinery (thread counts, niceness, the fused step, the LM head screen) is not part of this runner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.decode.block_pool import BlockPool
from services.decode.gpu_forward import IDS, POS, SLOT, GpuDecoder, StepBuffers
from services.decode.gpu_graphs import StepGraphs, step_buckets
from services.decode.request_blocks import RequestBlocks
from services.decode.runner import StepReport, check_prefill
from services.models.base import LanguageModel
from services.models.head_screen import ScreenReport
from services.observability.compute_metrics import compute_timer
from services.sampling.sampler import RowSampling, Sampler


class GpuRunner:
    threads = 1          # the engine's describe(): no torch thread pool to size
    serial_rows = 0
    serial_steps = 0
    screen = None
    screen_counts = (0, 0, 0)
    attention_kernel = "flex"

    def __init__(self, lm: LanguageModel, pool: BlockPool, max_rows: int, max_model_len: int, sampler: Sampler,
                 buckets: Sequence[int] | None = None) -> None:
        self.lm, self.pool, self.sampler = lm, pool, sampler
        self.device = pool.kv.device
        self.max_rows, self.max_blocks = max_rows, pool.blocks_for(max_model_len)
        self.decoder = GpuDecoder(lm, pool, max_rows, self.max_blocks)
        self.host = StepBuffers.allocate(max_rows, self.max_blocks, "cpu", pin=self.device.type == "cuda")
        self._step64, self._meta = self.host.step64.numpy(), self.host.meta.numpy()
        self._tables = self.host.tables.numpy()
        self.graphs = StepGraphs(self.decoder, step_buckets(max_rows, buckets))
        self.step_report: StepReport = self.graphs.capture(self._pad_all)
        self.screen_report = ScreenReport("off", False, f"not on {self.device} (CPU only)")

    @property
    def step_mode(self) -> str:
        return self.graphs.report.mode

    @property
    def graph_replays(self) -> int:
        """Steps that replayed a captured CUDA graph (the GPU check counts them)."""
        return self.graphs.replays

    def check_prefill(self, kv: torch.Tensor, prompt_len: int) -> None:
        check_prefill(self.lm.layout, kv, prompt_len)

    def enter_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def before_step(self) -> None:
        """Nothing: niceness is a CPU role's knob (services/models/device_plan.py)."""

    def place(self, row: int, blocks: RequestBlocks) -> None:
        ids = blocks.blocks
        self._tables[row, :len(ids)] = ids

    def move(self, src: int, dst: int, num_blocks: int) -> None:
        if src != dst:
            self._tables[dst, :num_blocks] = self._tables[src, :num_blocks]

    def step(self, last_tokens: Sequence[int], rope_deltas: Sequence[int], blocks: Sequence[RequestBlocks],
             rows: Sequence[RowSampling]) -> list[int]:
        """Feed each row's last token at its own position; returns one sampled token per row."""
        with compute_timer("decode_step"):
            return self._step(last_tokens, rope_deltas, blocks, rows)

    def _step(self, last_tokens: Sequence[int], rope_deltas: Sequence[int], blocks: Sequence[RequestBlocks],
              rows: Sequence[RowSampling]) -> list[int]:
        count, size = len(last_tokens), self.pool.block_size
        step, meta, tables = self._step64, self._meta, self._tables
        for row, (token, delta, seq) in enumerate(zip(last_tokens, rope_deltas, blocks, strict=True)):
            position = seq.num_tokens
            block, offset, is_new = seq.append_slot()
            if is_new:
                tables[row, len(seq.blocks) - 1] = block
            step[IDS, row], step[POS, row], step[SLOT, row] = token, position + delta, block * size + offset
            meta[row] = seq.num_tokens
        bucket = self.graphs.bucket_for(count)
        self._pad(count, bucket)
        self.decoder.buffers.send(self.host, bucket)
        logits, argmax = self.graphs.run(bucket)
        tokens: list[int] = argmax[:count].tolist()   # the step's one wait: its tokens come back
        others = [i for i, row in enumerate(rows) if not row.plain_greedy]
        if others:
            picked = self.sampler.sample(logits[others].float(), [rows[i] for i in others], inplace=True)
            for i, token in zip(others, picked, strict=True):
                tokens[i] = token
        return tokens

    def _pad(self, count: int, bucket: int) -> None:
        """Rows count..bucket-1 become padding: token 0 at position 0, K/V to and from the scratch block."""
        scratch = self.pool.scratch_block
        self._step64[IDS, count:bucket] = self._step64[POS, count:bucket] = 0
        self._step64[SLOT, count:bucket] = scratch * self.pool.block_size
        self._meta[count:bucket] = 1
        self._tables[count:bucket, 0] = scratch
        self._meta[-1] = count

    def _pad_all(self, bucket: int) -> None:
        """Every row of `bucket` padding, sent to the device (graph warm-up and capture)."""
        self._pad(0, bucket)
        self.decoder.buffers.send(self.host, bucket)
