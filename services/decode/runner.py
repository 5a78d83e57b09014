"""The model side of a decode step: one paged forward for all active rows, then sampling.

Owned and called only by the engine's worker thread.  Row i of every step tensor is the
engine's row i; each row's block table lives in row i of the preallocated `tables` [max_rows,
max_blocks_per_request] int32 tensor, written only when a row gains a block (or moves, when a
leaving row is filled by the last one).  Per step the host work is O(rows): one block/offset
per row for the new token, its position and its length, written into preallocated buffers.

The forward runs fused or eagerly: fused (services/decode/fused.py, `fused` "auto" or "on"), the decoder
stack of a step is one C call, taken wherever it applies; otherwise the eager paged forward
(services/decode/paged_forward.py).  These are the two step paths: a torch.compile'd step was measured
beside them and deleted (docs/benchmarks.md, "Native kernels: kept or deleted").

Threads: a step of at most `serial_rows` rows runs on one thread, larger ones on torch's thread
count (as found when the runner is built); the fused step has its own value (`fused_serial_rows`).
On a small box the coordinator, the client and this process's own event loop wake for every token; an
eager step spread over every core then waits at each of its op's OpenMP barriers for whichever thread
the scheduler preempted for them.  Measured on 2 cores (benchmarks/decode_threads.py): eager, one
thread wins clearly up to 4 rows and is a wash beyond; fused (one OpenMP region per step), both
threads win at 1, 2 and 4 rows.  So the decode role's auto setting runs no fused step serially, and
unfused steps of up to 4 rows on one thread there, one-row steps elsewhere
(services/decode/app.py; docs/benchmarks.md, "Decode threads").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.decode.attention import TorchPagedAttention
from services.decode.block_pool import BlockPool
from services.decode.fused import choose_fused
from services.decode.paged_forward import PagedDecoder
from services.decode.request_blocks import RequestBlocks
from services.hostcpu import compute_lease, compute_threads, role_cpu
from services.models.base import KVLayout, LanguageModel
from services.models.head_screen import HeadScreen, build_screen
from services.observability.compute_metrics import compute_timer
from services.sampling import screened
from services.sampling.sampler import RowSampling, Sampler

# a prefilled KV of these dtypes widens exactly into blocks of those (prefill in bfloat16 beside a decode
# that keeps float32 activations over bfloat16 weights: services/decode/app.py bf16_weights)
_WIDENS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}
# Rows of the runner's int64 step buffer [4, max_rows]: token ids, positions, write blocks, write offsets.
IDS, POS, BLOCK, OFFSET = range(4)


@dataclass
class StepReport:
    """How the decode step runs, "fused" or "eager", and why (the start-up log and /metrics)."""

    mode: str
    reason: str = ""

    def line(self) -> str:
        return f"decode step {self.mode}{' (' + self.reason + ')' if self.reason else ''}"


StepInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def step_inputs(step64: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, rows: int, device: torch.device
                ) -> StepInputs:
    """The forward's inputs for the first `rows` rows of the step buffers (views on CPU): token ids, positions,
    write blocks, write offsets, block tables, lengths."""
    step = step64[:, :rows].to(device)
    return step[IDS], step[POS], step[BLOCK], step[OFFSET], tables[:rows].to(device), lens[:rows].to(device)


def check_prefill(layout: KVLayout, kv: torch.Tensor, prompt_len: int) -> None:
    """Raises ValueError unless kv is a prefilled KV of `prompt_len` tokens that loads into `layout`'s blocks."""
    expected = (layout.num_layers, 2, layout.num_kv_heads, prompt_len, layout.head_dim)
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != expected:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv must have shape {expected}, got {shape}")
    if kv.dtype != layout.dtype and (kv.dtype, layout.dtype) not in _WIDENS:
        raise ValueError(f"kv dtype must be the model dtype {layout.dtype}, got {kv.dtype}")


class DecodeRunner:
    def __init__(self, lm: LanguageModel, pool: BlockPool, max_rows: int, max_model_len: int, sampler: Sampler,
                 serial_rows: int = 0, fused: str = "auto",
                 fused_serial_rows: int | None = None, lm_head_screen: str = "auto") -> None:
        self.lm, self.pool, self.sampler = lm, pool, sampler
        self.threads, self.serial_rows = compute_threads.count(), serial_rows
        self.serial_steps = 0       # steps that ran on one thread (engine stats, /metrics)
        self._yielded_before = 0.0  # yielded_s before the last step (before_step)
        self.device = pool.kv.device
        self.attention = TorchPagedAttention()
        self.decoder = PagedDecoder(lm, pool, self.attention)
        self.max_blocks = pool.blocks_for(max_model_len)
        self.tables = torch.zeros((max_rows, self.max_blocks), dtype=torch.int32)
        self._step64 = torch.zeros((4, max_rows), dtype=torch.int64)
        self._lens = torch.zeros(max_rows, dtype=torch.int32)
        self._step64_np, self._lens_np = self._step64.numpy(), self._lens.numpy()
        self.fused, why_not = choose_fused(self.decoder, fused, max_rows)
        if self.fused is not None:
            if fused_serial_rows is not None:   # the fused step's own thread policy (decode/app.py serial_rows)
                self.serial_rows = fused_serial_rows
            self.step_report = StepReport("fused", f"--decode-fused {fused}: the decoder stack in one C call")
        else:
            self.step_report = StepReport("eager", "--decode-fused off" if fused == "off" else f"not fused: {why_not}")
        # greedy rows' tokens from a bfloat16 screen of the head, decided in float32 (services/models/head_screen.py)
        self.screen, self.screen_report = build_screen(lm.lm_head, lm_head_screen)

    @property
    def step_mode(self) -> str:
        """"fused" or "eager"."""
        return self.step_report.mode

    @property
    def attention_kernel(self) -> str:
        return self.attention.name

    def check_prefill(self, kv: torch.Tensor, prompt_len: int) -> None:
        """Raises ValueError unless kv can be loaded for a prompt of `prompt_len` tokens."""
        check_prefill(self.lm.layout, kv, prompt_len)

    def enter_thread(self) -> None:
        """The engine's worker thread starts: the process's one multi-threaded torch thread (compute_threads.py)."""
        compute_threads.enter()

    def before_step(self) -> None:
        """Decode's niceness while a long prompt prefills (role_cpu.py); a compute-lease flag a killed prompt-side
        holder left is cleared once a step paused its whole budget for it (compute_lease.py)."""
        role_cpu.follow_long_prefill()
        yielded = self.yielded_s
        if yielded - self._yielded_before >= 0.9 * compute_lease.YIELD_BUDGET_S:
            follower = compute_lease.follower()
            if follower is not None:
                follower.clear_stale()
        self._yielded_before = yielded

    def place(self, row: int, blocks: RequestBlocks) -> None:
        """Row `row` now belongs to `blocks`: copy its block table in (done when a request joins)."""
        ids = blocks.blocks
        self.tables[row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)

    def move(self, src: int, dst: int, num_blocks: int) -> None:
        if src != dst:
            self.tables[dst, :num_blocks] = self.tables[src, :num_blocks]

    def step(self, last_tokens: Sequence[int], rope_deltas: Sequence[int], blocks: Sequence[RequestBlocks],
             rows: Sequence[RowSampling]) -> list[int]:
        """Feed each row's last token at its own position; returns one sampled token per row."""
        with compute_timer("decode_step"):
            return self._step(last_tokens, rope_deltas, blocks, rows)

    @torch.inference_mode()
    def _step(self, last_tokens: Sequence[int], rope_deltas: Sequence[int], blocks: Sequence[RequestBlocks],
              rows: Sequence[RowSampling]) -> list[int]:
        count = len(last_tokens)
        threads = 1 if count <= self.serial_rows else self.threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if threads < self.threads:
            self.serial_steps += 1
        buf, lens = self._step64_np, self._lens_np
        num_blocks: list[int] = []
        for row, (token, delta, seq) in enumerate(zip(last_tokens, rope_deltas, blocks, strict=True)):
            position = seq.num_tokens
            block, offset, is_new = seq.append_slot()
            if is_new:
                self.tables[row, len(seq.blocks) - 1] = block
            buf[IDS, row], buf[POS, row] = token, position + delta
            buf[BLOCK, row], buf[OFFSET, row] = block, offset
            lens[row] = seq.num_tokens
            num_blocks.append(len(seq.blocks))
        screen = self._screen_for(rows)
        if self.fused is not None:
            return self._pick(self.fused(*self._inputs(count), head=screen is None)[:count], rows, screen)
        out = self.decoder.forward(*self._inputs(count), num_blocks, head=screen is None)
        return self._pick(out[:count], rows, screen)

    def _screen_for(self, rows: Sequence[RowSampling]) -> HeadScreen | None:
        """The screen when this step may use it: every row plain greedy or plain sampled."""
        if self.screen is None:
            return None
        samples = self.screen.samples
        return self.screen if all(row.plain_greedy or (samples and row.plain_sampled) for row in rows) else None

    def _pick(self, out: torch.Tensor, rows: Sequence[RowSampling], screen: HeadScreen | None) -> list[int]:
        """Tokens from the step's logits, or from its normed hidden states through `screen`; a row the
        screen cannot decide runs the full head."""
        if screen is None:
            return self.sampler.sample(out, rows, inplace=True)
        tokens = screened.pick(screen, out, rows, self.sampler.rng)
        full = [i for i, token in enumerate(tokens) if token < 0]
        if full:
            picked = self.sampler.sample(self.lm.lm_head(out[full]), [rows[i] for i in full], inplace=True)
            for i, token in zip(full, picked, strict=True):
                tokens[i] = token
        return tokens

    @property
    def yielded_s(self) -> float:
        """Seconds the steps paused for prompt-side forwards sharing the cores (compute_lease.py)."""
        return self.decoder.yielded_s + (self.fused.yielded_s if self.fused is not None else 0.0)

    @property
    def screen_counts(self) -> tuple[int, int, int]:
        """(rows the screen decided, rows sent to the full head, float32 logits computed for candidates)."""
        s = self.screen
        return (s.rows_screened, s.rows_full, s.candidates) if s is not None else (0, 0, 0)

    def _inputs(self, rows: int) -> StepInputs:
        return step_inputs(self._step64, self.tables, self._lens, rows, self.device)
