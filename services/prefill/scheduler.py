"""Which prompt rows the next prefill forward runs: FIFO, under a token budget, chunking long prompts.

Waiting jobs are taken in arrival order.  Each forward gets at most `max_num_batched_tokens`
rows; a prompt that does not fit what is left of the budget runs its first rows now and the
rest in the following forwards (chunked prefill: its KV stays in its blocks in between), so a
forward never grows past the budget however long a prompt is, and a partially done prompt is
always first in line for the next forward.  At most one prompt is partially done at a time.

A job is *admitted* when it first gets rows: its future is marked running (a cancelled one is
dropped), its inputs are prepared (an item that does not fit fails only that job), its
leading full blocks are looked up in the prefix cache (shared by reference) and the rest of
its blocks are allocated.  When the pool cannot give the blocks, admission stops there (FIFO
order is kept) until a finished prompt releases its own.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.prefill.blocks import BlockManager
from services.prefill.jobs import PrefillJob
from services.prefill.prefix_cache import block_hashes


@dataclass(frozen=True)
class Scheduled:
    """Rows [start, end) of `job` run in the next forward."""

    job: PrefillJob
    start: int
    end: int

    @property
    def finishes(self) -> bool:
        return self.end == self.job.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, block_size: int, max_num_batched_tokens: int,
                 prepare: Callable[[PrefillJob], None], use_prefix_cache: bool, scope: str = "") -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.blocks, self.block_size = blocks, block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.use_prefix_cache = use_prefix_cache
        self.scope = scope   # the weight version: part of every prefix-cache key (prefix_cache.py)
        self._prepare = prepare
        self.waiting: deque[PrefillJob] = deque()

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, job: PrefillJob) -> None:
        self.waiting.append(job)

    def next_batch(self) -> list[Scheduled]:
        """The next forward's rows; [] when nothing can run now (empty, or the pool is full)."""
        budget, batch = self.max_num_batched_tokens, []
        for job in list(self.waiting):
            if budget == 0:
                break
            if not job.blocks and not self._admit(job):
                if job in self.waiting:
                    break  # the pool is full: later jobs wait their turn
                continue   # cancelled or failed: gone
            rows = min(job.num_remaining, budget)
            batch.append(Scheduled(job, job.num_done, job.num_done + rows))
            budget -= rows
        return batch

    def advance(self, batch: list[Scheduled]) -> None:
        """The forward ran: rows are in the pool, full blocks are published, finished jobs leave."""
        for item in batch:
            job = item.job
            job.num_done = item.end
            if self.use_prefix_cache:
                for index in range(job.num_cached // self.block_size, min(item.end // self.block_size,
                                                                          len(job.keys))):
                    self.blocks.publish(job.keys[index], job.blocks[index])
            if item.finishes:
                self.waiting.remove(job)

    def drop(self, job: PrefillJob) -> None:
        """Forget a job (failed); its blocks go back."""
        if job in self.waiting:
            self.waiting.remove(job)
        blocks, job.blocks = job.blocks, []
        if blocks:
            self.blocks.release(blocks)

    def _admit(self, job: PrefillJob) -> bool:
        if job.inputs is None and not self._start(job):
            return False
        hits = self._lookup(job)
        needed = -(-job.num_tokens // self.block_size) - len(hits)
        own = self.blocks.allocate(needed)
        if own is None:
            if hits:
                self.blocks.release(hits)
            return False
        job.blocks = hits + own
        job.num_cached = job.num_done = len(hits) * self.block_size
        return True

    def _start(self, job: PrefillJob) -> bool:
        if not job.future.set_running_or_notify_cancel():
            self.waiting.remove(job)
            return False
        try:
            self._prepare(job)
        except Exception as exc:  # the job's own input is bad: only its caller hears of it
            self.waiting.remove(job)
            job.future.set_exception(exc)
            return False
        return True

    def _lookup(self, job: PrefillJob) -> list[int]:
        if not self.use_prefix_cache or job.prompt_logprobs is not None:   # prompt logprobs need every row run
            return []
        if not job.keys:
            job.keys = block_hashes(job.token_ids, job.items, job.cache_salt, self.block_size, self.scope)
        usable = (job.num_tokens - 1) // self.block_size  # keep at least one token to compute: its logits
        return self.blocks.lookup(job.keys[:usable])
