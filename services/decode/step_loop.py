"""The decode engine's worker thread (mixed into DecodeEngine: its lock, rows and registry).

Between steps it takes the new requests that go on, applies aborts, and admits waiting requests into
free rows (FIFO, at most `num_slots` rows).  A step is one forward for all active rows; active
requests occupy rows 0..n-1, and a leaving request's row is filled by the last one (its block table
row moves, its KV does not).  An exception in a step is put down to the rows that cause it: the step
runs again for each row alone, and only a row that fails alone ends (finish_reason "error"); the
others take the tokens their own steps gave and carry on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from services.decode.request import DecodeRequest
from services.decode.stream import DecodeEvent
from services.generation.stop import FINISH_ABORT, FINISH_ERROR

if TYPE_CHECKING:
    from services.decode.gpu_runner import GpuRunner
    from services.decode.runner import DecodeRunner

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5   # the worker re-checks its flags at least this often when idle


class StepLoop:
    """The worker thread's half of DecodeEngine (services/decode/engine.py)."""

    if TYPE_CHECKING:   # DecodeEngine's, used here
        num_slots: int
        _cond: threading.Condition
        _runner: DecodeRunner | GpuRunner
        _requests: dict[str, DecodeRequest]
        _groups: dict[str, Any]
        _inbox: deque[DecodeRequest]
        _aborts: set[str]
        _waiting: deque[DecodeRequest]
        _rows: list[DecodeRequest]
        _closed: bool
        _steps: int
        _tokens: int
        _finished: int
        _poison: str

    def _run(self) -> None:
        self._runner.enter_thread()   # CPU: the process's one multi-threaded torch thread (compute_threads.py)
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work, _IDLE_WAIT_S)
                if self._closed:
                    break
                inbox, self._inbox = list(self._inbox), deque()
                aborts, self._aborts = self._aborts, set()
            try:
                self._iterate(inbox, aborts)
            except Exception as exc:  # a bug here must not kill the thread and hang every stream
                logger.exception("decode engine iteration failed")
                self._fail_all(f"decode engine error: {type(exc).__name__}")
        self._shutdown()

    def _iterate(self, inbox: list[DecodeRequest], aborts: set[str]) -> None:
        self._take(inbox)
        self._apply_aborts(aborts)
        self._admit()
        if self._rows:
            self._runner.before_step()   # CPU: decode's niceness while a long prompt prefills (role_cpu.py)
            self._step()

    def _has_work(self) -> bool:
        can_admit = bool(self._waiting) and len(self._rows) < self.num_slots
        return self._closed or bool(self._inbox or self._aborts or self._rows) or can_admit

    def _take(self, inbox: list[DecodeRequest]) -> None:
        """New requests (their first token already emitted by `submit`) wait for a slot."""
        self._waiting.extend(request for request in inbox if not request.finished)

    def _apply_aborts(self, aborts: set[str]) -> None:
        for request_id in aborts:
            request = self._requests.get(request_id)
            if request is None or request.finished:
                continue
            with self._cond:     # against `start`: the abort is applied here or there, never lost
                if not request.started:  # its KV is being loaded into its blocks: `start`/`fail` end it
                    request.abort_asked = True
                    continue
            if request in self._rows:
                self._release(self._rows.index(request))
            elif request in self._waiting:
                self._waiting.remove(request)
            self._end(request, request.end(FINISH_ABORT))

    def _admit(self) -> None:
        while self._waiting and len(self._rows) < self.num_slots:
            request = self._waiting.popleft()
            self._runner.place(len(self._rows), request.blocks)
            self._rows.append(request)

    def _step(self) -> None:
        rows = self._rows
        lengths = [r.blocks.num_tokens for r in rows]
        try:
            tokens: list[int | None] = list(self._forward(rows))
        except Exception:
            logger.exception("decode step of %d rows failed; running each row alone", len(rows))
            tokens = self._isolate(rows, lengths)
        self._steps += 1
        done = [row for row, (request, token) in enumerate(zip(rows, tokens, strict=True))
                if token is None or self._emit_token(request, token) is not None]
        for row in reversed(done):   # descending: a moved (last) row is never one still to release
            self._release(row)

    def _forward(self, rows: list[DecodeRequest]) -> list[int]:
        if self._poison and any(self._poison in r.request_id for r in rows):   # FAKE: tests poison a step
            raise RuntimeError("FAKE decode step fault (EPD_FAKE_DECODE_POISON)")
        return self._runner.step([r.last_token for r in rows], [r.rope_delta for r in rows],
                                 [r.blocks for r in rows], [r.sampling for r in rows])

    def _isolate(self, rows: list[DecodeRequest], lengths: list[int]) -> list[int | None]:
        """A failed step run again one row at a time (in row 0, its table placed there), each row's KV first
        cut back to what it held before the step: a row that fails alone ends with an error (None), the rest
        get their tokens.  Every row's table is placed back in its own row afterwards."""
        tokens: list[int | None] = []
        for request, length in zip(rows, lengths, strict=True):
            request.blocks.truncate(length)
            self._runner.place(0, request.blocks)
            try:
                tokens.append(self._forward([request])[0])
            except Exception as exc:  # noqa: BLE001 - this row's own failure: it alone ends
                logger.exception("decode step of request %s failed on its own", request.request_id)
                self._end(request, request.end(FINISH_ERROR, f"decode step failed: {type(exc).__name__}"))
                tokens.append(None)
        for row, request in enumerate(rows):
            self._runner.place(row, request.blocks)
        return tokens

    def _emit_token(self, request: DecodeRequest, token: int) -> DecodeEvent | None:
        """Accept and emit one token; returns the final event if the request ended."""
        try:
            event = request.accept(token)
        except Exception as exc:
            logger.exception("processing a token of request %s failed", request.request_id)
            event = request.end(FINISH_ERROR, f"token processing failed: {type(exc).__name__}")
        with self._cond:   # submit's thread emits first tokens too
            self._tokens += 1
        if event.finished:
            self._end(request, event)
            return event
        request.emit(event)
        return None

    def _release(self, row: int) -> None:
        """Free `row`; the last active row moves into it so rows stay contiguous."""
        last = len(self._rows) - 1
        self._runner.move(last, row, len(self._rows[last].blocks.blocks))
        self._rows[row] = self._rows[last]
        self._rows.pop()

    def _end(self, request: DecodeRequest, event: DecodeEvent) -> None:
        # Forget the id first: a consumer may resubmit it as soon as it sees the final event.
        request.blocks.release()
        with self._cond:
            self._requests.pop(request.key, None)
            self._finished += 1
        request.emit(event)
        if request.key != request.request_id:
            with self._cond:
                group = self._groups.get(request.request_id)
                if group is not None and group.finished:
                    del self._groups[request.request_id]

    def _fail_all(self, message: str) -> None:
        rows, self._rows = self._rows, []
        for request in rows:
            self._end(request, request.end(FINISH_ERROR, message))

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._requests.values())
        self._rows, self._waiting = [], deque()
        with self._cond:
            inbox, self._inbox = list(self._inbox), deque()
        for request in inbox:
            request.blocks.release()
        for request in pending:
            if not request.finished:
                self._end(request, request.end(FINISH_ABORT, "decode engine closed"))
