"""The prefill engine: prompts in, first-token logits and KV (in pool blocks) out, batched and chunked.

Who calls what: the prefill role's serving core calls `submit` from any thread (it never
blocks on the model) and awaits the returned future of a `HeldPrefill`, whose `fill` copies
the KV into the KV store and whose `release` gives the blocks back; `prefill` is the
blocking form that returns a `PrefillResult` with a KV tensor of its own (tests, tools).

One worker thread runs the forwards, one at a time (the model is shared and a CPU forward
already uses every core).  `submit(..., inline=True)` lets an idle engine run a small prompt
(one forward, under `compute_threads.INLINE_FORWARD_FLOPS`) on the caller's own thread before
returning its future, done: no hand-off to the worker and back (two thread wake-ups).  Each
forward packs the rows the scheduler picks — waiting prompts in arrival order under
`max_num_batched_tokens`, long prompts in chunks (scheduler.py) — into one sequence
(packing.py, attention.py).  The worker exits after `idle_exit_s` without work and starts
again with the next submit, so an engine nobody uses holds no thread.

KV memory is one pool (kv_pool.py) of `block_size`-token blocks sized at construction:
`prefix_cache_mb` for blocks kept for later prompts with the same prefix (the prefix cache,
LRU over unreferenced blocks; 0 turns it off), plus room for one `max_model_len` prompt and two
forwards' worth of prompts in flight.  The prefix cache shares blocks by reference: a hit's
blocks are read in place (gathered once into the forward's attention), a finished prompt's
full blocks are published as they are.  Tokens are the same with or without hits and
batched or alone (logits agree to float rounding: matmuls of other shapes sum in other orders).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.generation.params import DecodeParams
from services.hostcpu import compute_lease, compute_threads, role_cpu
from services.models.base import LanguageModel, MultiModalInput
from services.models.forward_cost import PrefillCost
from services.models.head_screen import build_screen
from services.observability import activity
from services.observability.compute_metrics import compute_timer
from services.prefill import attention, last_rows
from services.prefill.blocks import BlockManager
from services.prefill.jobs import HeldPrefill, PrefillJob, release_when_done
from services.prefill.kv_pool import KVPool, block_bytes
from services.prefill.packing import Chunk, forward_rows
from services.prefill.prefix_cache import BLOCK_SIZE
from services.prefill.prompt_logprobs import chunk_records
from services.prefill.scheduler import Scheduled, Scheduler
from services.sampling import screened
from services.sampling.sampler import RowSampling, greedy_argmax

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_PREFIX_CACHE_MB = 256
TURN_POLL_S = 0.0005   # how often a ready forward looks whether decode's turn is over (compute_lease.turn_pending)


@dataclass
class PrefillResult:
    first_logits: torch.Tensor   # [vocab] float32: logits for the token after the prompt
    kv: torch.Tensor             # [num_layers, 2, num_kv_heads, L, head_dim], model dtype
    rope_delta: int              # decode position of sequence index n is n + rope_delta
    num_prompt_tokens: int       # L
    num_cached_tokens: int = 0   # leading tokens whose KV came from the prefix cache


class PrefillEngine:
    """Batched, chunked prefill over a language model; thread-safe."""

    def __init__(self, lm: LanguageModel, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB, block_size: int = BLOCK_SIZE,
                 idle_exit_s: float = 5.0, lm_head_screen: str = "auto", native_attention: bool = True,
                 cache_scope: str = "") -> None:
        # native: the AVX-512 kernel (CPU only: services/models/device_plan.py)
        attention.install(lm, native_attention)
        # greedy prompts' first tokens from a bfloat16 screen of the head, decided in float32
        self.screen, self.screen_report = build_screen(lm.lm_head, lm_head_screen)
        self._last_rows = last_rows.install(lm)
        self.lm, self.block_size, self.idle_exit_s = lm, block_size, idle_exit_s
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))   # unseeded first-token draws
        self._cost = PrefillCost(lm)  # a forward's FLOPs: a small one runs on one thread (compute_threads.use_for)
        self.max_num_batched_tokens = max_num_batched_tokens
        max_cached = int(prefix_cache_mb * 2**20) // block_bytes(lm.layout, block_size)
        working = -(-(lm.layout.max_model_len + 2 * max_num_batched_tokens) // block_size)
        self.pool = KVPool(lm.layout, max_cached + working, block_size, lm.device)
        self.blocks = BlockManager(max_cached + working, max_cached)
        self._scheduler = Scheduler(self.blocks, block_size, max_num_batched_tokens, self._prepare,
                                    use_prefix_cache=max_cached > 0, scope=cache_scope)
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._busy = False   # a forward runs (the worker's or an inline one): the other waits
        self.num_prefills = self.num_prompt_tokens = self.num_cached_tokens = 0
        self.num_forwards = 0
        self.recent_batches: deque[tuple[int, int]] = deque(maxlen=256)  # (chunks, rows) per forward

    @property
    def num_waiting(self) -> int:
        """Prompts submitted and not finished (running or waiting)."""
        return len(self._scheduler)

    @property
    def num_running(self) -> int:
        """Prompts holding KV blocks: being prefilled (a scrape reads it; a copy of the queue, no lock)."""
        return sum(1 for job in list(self._scheduler.waiting) if job.blocks)

    def submit(self, token_ids: list[int], mm_items: list[MultiModalInput] | None = None,
               cache_salt: str | None = None,
               on_finish: Callable[[HeldPrefill], None] | None = None, greedy: bool = False,
               inline: bool = False, prompt_logprobs: int | None = None,
               logprobs_mode: str = "raw_logprobs", draws: Sequence[DecodeParams] = (),
               hands_off: bool = False) -> Future[HeldPrefill]:
        """Queue one prompt; the future resolves to its HeldPrefill (release it!) or to the error
        (ValueError / InvalidMultiModalInput for items that do not fit the prompt).  `on_finish(held)`
        runs on the engine thread first (an exception from it fails the future, the blocks released).
        `greedy`: the caller takes the first token's plain argmax, so `HeldPrefill.first_tokens` carries it
        (decided by the LM head screen, or the full head's argmax on the engine thread) instead of
        `first_logits`.  `draws`: each sample's first-token params, all plain sampled (`can_draw`): the tokens
        are drawn through the screen (services/sampling/screened.py), the logits kept only where it cannot.
        `inline`: an idle engine may run it on this thread (returns the future done).
        `prompt_logprobs`: the top n per prompt token too (`HeldPrefill.prompt_records`; prompt_logprobs.py).
        `hands_off`: its first token goes on to a decode on these cores, which sends it before the next prompt
        forward starts (decode's turn, services/hostcpu/compute_lease.py)."""
        self._check_length(token_ids)
        job = PrefillJob(list(token_ids), list(mm_items or []), cache_salt, on_finish=on_finish, greedy=greedy,
                         prompt_logprobs=prompt_logprobs, logprobs_mode=logprobs_mode, draws=tuple(draws),
                         hands_off=hands_off)
        with self._cond:
            if self._closed:
                raise RuntimeError("the prefill engine is closed")
            self._scheduler.add(job)
            batch = self._inline_batch(job) if inline else None
            if batch is None:
                self._wake_worker()
                return job.future
        try:
            with compute_lease.taken_now("prefill") as taken:   # never waited for on the caller's loop
                if taken:
                    activity.mark("prefill.engine_batch")
                    self._forward(batch)
        finally:
            with self._cond:
                self._busy = False
                if len(self._scheduler):
                    self._wake_worker()   # prompts that came meanwhile, or this one when the lease was not free
        return job.future

    def _wake_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="prefill-engine", daemon=True)
            self._worker.start()
        self._cond.notify()

    def _inline_batch(self, job: PrefillJob) -> list[Scheduled] | None:
        """(Under the lock.) The forward of `job`, just added, when it is the only prompt, the engine is idle and
        the whole prompt is one forward small enough for the caller's thread: the engine is then marked busy.
        Else None, and the job is left as it was (not admitted: a caller that gives up can still cancel it)."""
        if self._busy or len(self._scheduler) != 1 or job.num_tokens > self.max_num_batched_tokens or \
                self._cost.flops([(0, job.num_tokens)], 1) > compute_threads.INLINE_FORWARD_FLOPS:
            return None
        batch = self._scheduler.next_batch()   # admits it (blocks, inputs): the rows the worker would take
        if len(batch) != 1 or not batch[0].finishes:
            return None
        self._busy = True
        return batch

    def prefill(self, token_ids: list[int], mm_items: list[MultiModalInput] | None = None,
                cache_salt: str | None = None, timeout: float | None = None) -> PrefillResult:
        """Prefill one prompt and wait; the KV comes back as a tensor of its own."""
        future = self.submit(token_ids, mm_items, cache_salt)
        try:
            held = future.result(timeout)
        except TimeoutError:
            release_when_done(future)
            raise
        with held:
            assert held.first_logits is not None   # not greedy: the logits are kept
            return PrefillResult(held.first_logits, held.kv(), held.rope_delta, held.num_prompt_tokens,
                                 held.num_cached_tokens)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the running forward; prompts not finished fail with RuntimeError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
        with self._cond:
            for job in list(self._scheduler.waiting):
                self._fail(job, RuntimeError("the prefill engine closed before the prompt ran"))

    def _check_length(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prefill needs at least one prompt token")
        if len(token_ids) > self.lm.layout.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens exceeds max_model_len "
                             f"{self.lm.layout.max_model_len}")

    def _prepare(self, job: PrefillJob) -> None:
        import torch

        with torch.no_grad():
            job.inputs = self.lm.prefill_inputs(job.token_ids, job.items)

    # ---- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        compute_threads.enter()   # the process's one multi-threaded torch thread (compute_threads.py)
        while (batch := self._next_batch()) is not None:
            activity.mark("prefill.engine_batch")
            try:
                self._forward(batch)
            finally:
                with self._cond:
                    self._busy = False

    def _next_batch(self) -> list[Scheduled] | None:
        """The next forward's rows; None when closed or idle for idle_exit_s (the thread then ends)."""
        with self._cond:
            while not self._closed:
                if not self._busy and len(self._scheduler) and compute_lease.turn_pending():
                    self._cond.wait(TURN_POLL_S)   # decode's turn first (compute_lease.py); prompts may join meanwhile
                    continue
                batch = [] if self._busy else self._scheduler.next_batch()
                if batch:
                    self._busy = True   # cleared by _run after the forward
                    return batch
                role_cpu.long_prompt_running(False)   # idle: no long prompt runs (decode's board byte cleared)
                if not self._cond.wait(self.idle_exit_s) and not len(self._scheduler):
                    break
            self._worker = None
            return None

    def _forward(self, batch: list[Scheduled]) -> None:
        import torch

        chunks = [Chunk(item.job.inputs, item.start, item.end, tuple(item.job.blocks))  # type: ignore[arg-type]
                  for item in batch]
        finishing = [index for index, item in enumerate(batch) if item.finishes]
        # a chunked (long) prompt's forwards yield the cores to decode: --role-nice prefill-long (role_cpu.py)
        long = any(item.job.num_tokens > self.max_num_batched_tokens for item in batch)
        role_cpu.long_prompt_running(long)
        # --role-threads prefill-long: a chunked prompt's forwards on fewer threads; a small forward on one
        compute_threads.use_for(self._cost.flops([(c.start, c.end) for c in chunks], len(finishing)), long)
        whole = frozenset(i for i, item in enumerate(batch) if item.job.prompt_logprobs is not None)
        try:
            with torch.no_grad(), compute_timer("prefill"):
                hidden, rows = forward_rows(self.lm, self.pool, chunks, self._last_rows, whole)
                tokens, logits = self._first_tokens(hidden[finishing], [batch[i].job for i in finishing])
                for index, states in rows.items():
                    item = batch[index]
                    item.job.prompt_records.extend(chunk_records(
                        self.lm.lm_head, states, item.job.token_ids, item.start, item.job.prompt_logprobs or 0,
                        item.job.logprobs_mode))
        except Exception as exc:  # every prompt of the batch hears of it; the engine carries on
            log.exception("prefill forward of %d chunks failed", len(batch))
            with self._cond:
                for item in batch:
                    self._fail(item.job, exc)
            return
        with self._cond:
            self._scheduler.advance(batch)
        self._count(batch, chunks)
        compute_lease.handed_off(sum(batch[index].job.hands_off for index in finishing))
        for row, index in enumerate(finishing):
            job = batch[index].job
            picked = tokens[row]
            held = HeldPrefill(job, None if picked is not None else logits[row], self.pool, self._release, picked)
            if job.on_finish is not None:
                try:
                    job.on_finish(held)
                except Exception as exc:  # the caller hears of it; the blocks go back
                    held.release()
                    job.future.set_exception(exc)
                    continue
            job.future.set_result(held)

    def can_draw(self, params: Sequence[DecodeParams]) -> bool:
        """Whether first tokens of these sample params are drawn through the LM head screen (all plain sampled;
        min_tokens would suppress EOS at the first token)."""
        return (self.screen is not None and self.screen.samples and bool(params)
                and all(p.min_tokens == 0 and RowSampling(p).plain_sampled for p in params))

    def _first_tokens(self, rows: torch.Tensor, jobs: list[PrefillJob]
                      ) -> tuple[list[list[int] | None], list[torch.Tensor | None]]:
        """Per finishing prompt: its picked tokens (greedy: [token]; drawn: one per sample; None: none) and else
        its logits [vocab] from the full head.  A greedy prompt's token is the LM head screen's pick, or the full
        head's argmax taken here, right after the forward (the sampler's own `greedy_argmax`, ties to the first
        index), so the caller's event loop never handles the [vocab] row; a prompt with `draws` has each sample's
        token drawn through the screen (services/sampling/screened.py), as decode draws its next ones."""
        tokens: list[list[int] | None] = [None] * len(jobs)
        if self.screen is not None:
            pick = [row for row, job in enumerate(jobs) if job.greedy]
            if pick:
                for row, token in zip(pick, self.screen.argmax(rows[pick]), strict=True):
                    tokens[row] = [token] if token >= 0 else None
            for row, job in enumerate(jobs):
                if job.draws and self.screen.samples:
                    x = rows[row:row + 1].expand(len(job.draws), -1).contiguous()
                    drawn = screened.draw(self.screen, x, [RowSampling(p) for p in job.draws], self._rng)
                    tokens[row] = drawn if min(drawn) >= 0 else None
        logits: list[torch.Tensor | None] = [None] * len(jobs)
        full = [row for row, token in enumerate(tokens) if token is None]
        if full:
            for row, values in zip(full, self.lm.lm_head(rows[full] if len(full) < len(jobs) else rows).float(),
                                   strict=True):
                if jobs[row].greedy:
                    tokens[row] = [int(greedy_argmax(values.unsqueeze(0))[0])]
                else:
                    logits[row] = values
        return tokens, logits

    def _count(self, batch: list[Scheduled], chunks: list[Chunk]) -> None:
        self.num_forwards += 1
        self.recent_batches.append((len(chunks), sum(chunk.num_tokens for chunk in chunks)))
        for item in batch:
            if item.finishes:
                self.num_prefills += 1
                self.num_prompt_tokens += item.job.num_tokens
                self.num_cached_tokens += item.job.num_cached

    def _fail(self, job: PrefillJob, exc: BaseException) -> None:
        self._scheduler.drop(job)
        if not job.future.done():
            if job.future.running() or job.future.set_running_or_notify_cancel():
                job.future.set_exception(exc)
        self._cond.notify_all()

    def _release(self, blocks: list[int]) -> None:
        self.blocks.release(blocks)
        with self._cond:
            self._cond.notify_all()  # a prompt may be waiting for blocks
