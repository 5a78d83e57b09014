"""The encode engine: batches items from concurrent callers into vision-tower forwards.

Each item's result is its EC entry, `VisionModel.encode_entries`: a dict of
named tensors ({"embedding"} and, per family, more such as Qwen3-VL's
"deepstack").

Transport-free.  Any number of threads call `encode(items)`; one worker thread
takes the waiting items in arrival order, as many as fit `max_batch_tokens`
(embedding tokens, as `VisionModel.num_tokens` counts them; an item larger
than the budget runs alone), and runs them as ONE forward.  No artificial
wait: while a forward runs, new items pile up and form the next batch, so
batches grow exactly when the tower is the bottleneck.

If a batched forward fails, its items are retried one by one so that one bad
item fails only its own caller.  The counters (`num_forwards`; `num_items` and
`num_tokens` of successfully encoded items) and `num_pending` feed metrics and
load reports.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from services.compute_metrics import compute_timer
from services.models.base import VisionModel
from services.protocol.errors import DeadlineExceeded, Unavailable

if TYPE_CHECKING:
    import torch


class _Job:
    """One item waiting for its embedding."""

    def __init__(self, item: dict[str, torch.Tensor], num_tokens: int) -> None:
        self.item = item
        self.num_tokens = num_tokens
        self.done = threading.Event()
        self.cancelled = False
        self.output: dict[str, torch.Tensor] | None = None
        self.error: BaseException | None = None

    def finish(self, output: dict[str, torch.Tensor] | None = None, error: BaseException | None = None) -> None:
        self.output, self.error = output, error
        self.done.set()


class EncodeEngine:
    """Thread-safe, batching front of a VisionModel. Call `close()` when done."""

    def __init__(self, vision: VisionModel, max_batch_tokens: int) -> None:
        if max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        self.vision = vision
        self.max_batch_tokens = max_batch_tokens
        self.num_forwards = 0
        self.num_items = 0
        self.num_tokens = 0
        self._pending: deque[_Job] = deque()
        self._wakeup = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="encode-engine", daemon=True)
        self._worker.start()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def encode(self, items: list[dict[str, torch.Tensor]],
               timeout: float | None = None) -> list[dict[str, torch.Tensor]]:
        """EC entries of `items`, in order; blocks until done. Raises DeadlineExceeded after `timeout` s."""
        jobs = [_Job(item, self.vision.num_tokens(item)) for item in items]  # bad metadata fails here, alone
        with self._wakeup:
            if self._closed:
                raise Unavailable("encode engine is closed")
            self._pending.extend(jobs)
            self._wakeup.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            self._wait(job, jobs, deadline)
        return [job.output for job in jobs]  # type: ignore[misc]

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker after the running forward; waiting callers get Unavailable."""
        with self._wakeup:
            self._closed = True
            abandoned, self._pending = list(self._pending), deque()
            self._wakeup.notify_all()
        for job in abandoned:
            job.finish(error=Unavailable("encode engine closed before the item was encoded"))
        self._worker.join(timeout)

    def __enter__(self) -> EncodeEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wait(self, job: _Job, jobs: list[_Job], deadline: float | None) -> None:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not job.done.wait(remaining):
            for other in jobs:
                other.cancelled = True  # the worker skips them if they have not started
            raise DeadlineExceeded(f"encoding {len(jobs)} item(s) did not finish in time")
        if job.error is not None:
            raise job.error

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if batch:
                self._encode(batch)

    def _next_batch(self) -> list[_Job] | None:
        """Waiting items that fit the budget (at least one); [] if all were cancelled; None once closed."""
        with self._wakeup:
            while not self._pending and not self._closed:
                self._wakeup.wait()
            if self._closed:
                return None
            batch = [self._pending.popleft()]
            tokens = batch[0].num_tokens
            while self._pending and tokens + self._pending[0].num_tokens <= self.max_batch_tokens:
                tokens += self._pending[0].num_tokens
                batch.append(self._pending.popleft())
        return [job for job in batch if not job.cancelled]

    def _encode(self, batch: list[_Job]) -> None:
        self.num_forwards += 1
        try:
            with compute_timer("encode"):
                outputs = self.vision.encode_entries([job.item for job in batch])
        except Exception as exc:  # reported to the callers, never lost
            if len(batch) == 1:
                batch[0].finish(error=exc)
            else:
                for job in batch:
                    self._encode([job])
            return
        for job, output in zip(batch, outputs, strict=True):
            job.finish(output=output)
        self.num_items += len(batch)
        self.num_tokens += sum(job.num_tokens for job in batch)
