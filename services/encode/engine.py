"""The encode engine: batches items from concurrent callers into vision-tower forwards.

Each item's result is its EC entry, `VisionModel.encode_entries`: a dict of
named tensors ({"embedding"} and, per family, more such as Qwen3-VL's
"deepstack").

Transport-free.  Callers on any thread `submit(items)` and get one future per
item at once (no thread waits per item, so the batcher sees every item of every
request that is waiting, not only as many as a thread pool has threads);
`encode(items, timeout)` is the blocking form.  One worker thread takes the
waiting items in arrival order, as many as fit `max_batch_tokens` (embedding
tokens, as `VisionModel.num_tokens` counts them; an item larger than the budget
runs alone), and runs them as ONE forward.  No artificial wait: while a forward
runs, new items pile up and form the next batch, so batches grow exactly when
the tower is the bottleneck.  Each future is resolved the moment its forward
ends, and the worker goes straight on to the next batch: whatever the caller
does with the entry (the EC put) overlaps the next forward.  A cancelled future
(a caller that gave up) is skipped if its forward has not started.

`run_inline(items)` is the idle engine's short cut: when nothing waits or runs
and the forward is small (`compute_threads.INLINE_FORWARD_FLOPS`), the caller's
own thread runs it (the role's event loop: no hand-off to the worker and back,
two thread wake-ups), and the worker takes nothing meanwhile.

If a batched forward fails, its items are retried one by one so that one bad
item fails only its own caller.  The counters (`num_forwards`; `num_items` and
`num_tokens` of successfully encoded items) and `num_pending` feed metrics and
load reports.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

from services.hostcpu import compute_lease, compute_threads
from services.models.base import VisionModel
from services.models.forward_cost import VisionCost
from services.observability import activity
from services.observability.compute_metrics import compute_timer
from services.protocol.errors import DeadlineExceeded, Unavailable

if TYPE_CHECKING:
    import torch


class _Job:
    """One item waiting for its EC entry."""

    def __init__(self, item: dict[str, torch.Tensor], num_tokens: int) -> None:
        self.item = item
        self.num_tokens = num_tokens
        self.future: Future[dict[str, torch.Tensor]] = Future()


class EncodeEngine:
    """Thread-safe, batching front of a VisionModel. Call `close()` when done."""

    def __init__(self, vision: VisionModel, max_batch_tokens: int) -> None:
        if max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        self.vision = vision
        self.max_batch_tokens = max_batch_tokens
        self._cost = VisionCost(vision)  # a forward's FLOPs: a small one runs on one thread (compute_threads.use_for)
        self.num_forwards = 0
        self.num_items = 0
        self.num_tokens = 0
        self._pending: deque[_Job] = deque()
        self._wakeup = threading.Condition()
        self._closed = False
        self._busy = False   # a forward runs (the worker's or an inline one): the other waits
        self._worker = threading.Thread(target=self._run, name="encode-engine", daemon=True)
        self._worker.start()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, items: list[dict[str, torch.Tensor]]) -> list[Future[dict[str, torch.Tensor]]]:
        """One future per item (its EC entry), in order. Bad metadata raises here, for these items only."""
        jobs = [_Job(item, self.vision.num_tokens(item)) for item in items]
        with self._wakeup:
            if self._closed:
                raise Unavailable("encode engine is closed")
            self._pending.extend(jobs)
            self._wakeup.notify()
        return [job.future for job in jobs]

    def run_inline(self, items: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]] | None:
        """The items' entries, computed on the calling thread when the engine is idle and the forward small;
        None when it is not (the caller submits them).  Raises what the forward raised."""
        tokens = [self.vision.num_tokens(item) for item in items]
        if sum(tokens) > self.max_batch_tokens or self._cost.flops(tokens) > compute_threads.INLINE_FORWARD_FLOPS:
            return None
        with self._wakeup:
            if self._closed or self._pending or self._busy:
                return None
            self._busy = True
        try:
            with compute_lease.taken_now("encode") as taken:   # never waited for on the caller's loop
                if not taken:
                    return None
                activity.mark("encode.engine_batch")
                return self._forward(items, tokens)
        finally:
            with self._wakeup:
                self._busy = False
                self._wakeup.notify()   # items that came meanwhile: the worker's

    def encode(self, items: list[dict[str, torch.Tensor]],
               timeout: float | None = None) -> list[dict[str, torch.Tensor]]:
        """EC entries of `items`, in order; blocks until done. Raises DeadlineExceeded after `timeout` s."""
        futures = self.submit(items)
        _, waiting = wait(futures, timeout)
        if waiting:
            for future in futures:
                future.cancel()  # the worker skips those whose forward has not started
            raise DeadlineExceeded(f"encoding {len(futures)} item(s) did not finish in time")
        return [future.result() for future in futures]

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker after the running forward; waiting callers get Unavailable."""
        with self._wakeup:
            self._closed = True
            abandoned, self._pending = list(self._pending), deque()
            self._wakeup.notify_all()
        for job in abandoned:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(Unavailable("encode engine closed before the item was encoded"))
        self._worker.join(timeout)

    def __enter__(self) -> EncodeEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        compute_threads.enter()   # the process's one multi-threaded torch thread (compute_threads.py)
        while (batch := self._next_batch()) is not None:
            try:
                if batch:
                    activity.mark("encode.engine_batch")
                    self._encode(batch)
            finally:
                with self._wakeup:
                    self._busy = False

    def _next_batch(self) -> list[_Job] | None:
        """Waiting items that fit the budget (at least one); [] if all were cancelled; None once closed."""
        with self._wakeup:
            while (not self._pending or self._busy) and not self._closed:
                self._wakeup.wait()
            if self._closed:
                return None
            self._busy = True   # cleared by _run after the forward, also for an all-cancelled []
            batch: list[_Job] = []
            tokens = 0
            while self._pending and (not batch or tokens + self._pending[0].num_tokens <= self.max_batch_tokens):
                job = self._pending.popleft()
                if job.future.set_running_or_notify_cancel():  # False: its caller gave up, skip it
                    batch.append(job)
                    tokens += job.num_tokens
        return batch

    def _encode(self, batch: list[_Job]) -> None:
        tokens = [job.num_tokens for job in batch]
        compute_threads.use_for(self._cost.flops(tokens))
        try:
            outputs = self._forward([job.item for job in batch], tokens)
        except Exception as exc:  # reported to the callers, never lost
            if len(batch) == 1:
                batch[0].future.set_exception(exc)
            else:
                for job in batch:
                    self._encode([job])
            return
        for job, output in zip(batch, outputs, strict=True):
            job.future.set_result(output)

    def _forward(self, items: list[dict[str, torch.Tensor]], tokens: list[int]) -> list[dict[str, torch.Tensor]]:
        """One forward over `items`, counted; only one runs at a time (`_busy`)."""
        self.num_forwards += 1
        with compute_timer("encode"):
            outputs = self.vision.encode_entries(items)
        self.num_items += len(items)
        self.num_tokens += sum(tokens)
        return outputs
