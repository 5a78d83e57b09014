"""The decode engine: continuous batching over a fixed number of KV slots.

Who calls what: the decode servicer / HTTP core calls `submit` (any thread)
with what prefill handed over (KV [num_layers, 2, num_kv_heads, prompt_len,
head_dim] in the model dtype, rope_delta, the first sampled token) and reads
the returned `DecodeStream`; `abort`, `stats` and `close` likewise.

One worker thread runs the loop.  Between steps it takes new requests (their
first token goes through the stop checks at once, so max_tokens=1 or an EOS
first token ends without a slot), applies aborts, and admits waiting requests
into free slots (FIFO).  A step is one forward for all active slots.  Active
requests occupy rows 0..n-1; a leaving request's row is filled by the last one.
An exception in a step fails the active requests (finish_reason "error") and
the engine carries on.

Capacity: num_slots running plus `max_queued` waiting; beyond that `submit`
raises EngineFull.  A request must fit: prompt_len + max_tokens <= max_model_len
(ContextTooLong otherwise); max_tokens=None means exactly that much.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.decode.detokenizer import IncrementalDetokenizer, decode_function
from services.decode.errors import ContextTooLong, EngineClosed, EngineFull
from services.decode.params import DecodeParams
from services.decode.request import DecodeRequest
from services.decode.runner import DecodeRunner
from services.decode.sampler import Sampler
from services.decode.stop import FINISH_ABORT, FINISH_ERROR
from services.decode.stream import DecodeEvent, DecodeStream
from services.models.base import LanguageModel
from services.protocol.errors import InvalidRequest

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5   # the worker re-checks its flags at least this often when idle


@dataclass(frozen=True)
class EngineStats:
    num_slots: int
    active: int       # requests holding a slot
    queued: int       # accepted, waiting for a slot
    steps: int        # forwards run
    tokens: int       # output tokens emitted (first tokens from prefill included)
    finished: int     # requests ended, any reason


class DecodeEngine:
    def __init__(self, lm: LanguageModel, tokenizer: Any, num_slots: int, max_model_len: int,
                 max_queued: int | None = None, stream_timeout: float | None = 60.0,
                 seed: int | None = None) -> None:
        if num_slots < 1 or max_model_len < 2:
            raise ValueError(f"need num_slots >= 1 and max_model_len >= 2, got {num_slots}, {max_model_len}")
        if max_model_len > lm.layout.max_model_len:
            raise ValueError(f"max_model_len {max_model_len} > the model's {lm.layout.max_model_len}")
        self.lm, self.tokenizer = lm, tokenizer
        self.num_slots, self.max_model_len = num_slots, max_model_len
        self.max_queued = 4 * num_slots if max_queued is None else max_queued
        self.stream_timeout = stream_timeout
        self._runner = DecodeRunner(lm, num_slots, max_model_len, Sampler(seed))
        self._decoders = {skip: decode_function(tokenizer, skip) for skip in (True, False)}
        self._cond = threading.Condition()
        self._requests: dict[str, DecodeRequest] = {}   # every request not yet finished
        self._inbox: deque[DecodeRequest] = deque()
        self._aborts: set[str] = set()
        self._waiting: deque[DecodeRequest] = deque()
        self._rows: list[DecodeRequest] = []
        self._closed = False
        self._steps = self._tokens = self._finished = 0
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    # ---- API (any thread) -------------------------------------------------------------------

    def submit(self, request_id: str, kv: Any, prompt_len: int, rope_delta: int, first_token: int,
               params: DecodeParams | None = None, on_event: Callable[[DecodeEvent], None] | None = None,
               prompt_token_ids: Sequence[int] | None = None) -> DecodeStream:
        """Queue a prefilled request; its events (the first token's included) arrive on the stream."""
        request = self._build(request_id, kv, prompt_len, rope_delta, first_token, params or DecodeParams(),
                              on_event, prompt_token_ids)
        with self._cond:
            if self._closed:
                raise EngineClosed("the decode engine is closed")
            if request_id in self._requests:
                raise InvalidRequest(f"request {request_id!r} is already being decoded",
                                     code="duplicate_request")
            if len(self._requests) >= self.num_slots + self.max_queued:
                raise EngineFull(f"decode is full: {self.num_slots} slots busy, {self.max_queued} waiting")
            self._requests[request_id] = request
            self._inbox.append(request)
            self._cond.notify()
        return request.stream

    def abort(self, request_id: str) -> bool:
        """Ends the request before the next step (finish_reason "abort"); False if it is not running."""
        with self._cond:
            if request_id not in self._requests:
                return False
            self._aborts.add(request_id)
            self._cond.notify()
            return True

    def stats(self) -> EngineStats:
        with self._cond:
            active = len(self._rows)
            return EngineStats(self.num_slots, active, len(self._requests) - active, self._steps,
                               self._tokens, self._finished)

    def close(self, timeout: float = 5.0) -> None:
        """Stops the worker (unfinished requests end with "abort"); waits at most `timeout` s."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self, request_id: str, kv: Any, prompt_len: int, rope_delta: int, first_token: int,
               params: DecodeParams, on_event: Callable[[DecodeEvent], None] | None,
               prompt_token_ids: Sequence[int] | None) -> DecodeRequest:
        if not 1 <= prompt_len < self.max_model_len:
            raise ContextTooLong(f"prompt_len {prompt_len} must be in [1, {self.max_model_len - 1}]")
        max_tokens = params.max_tokens or self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise ContextTooLong(f"prompt_len {prompt_len} + max_tokens {max_tokens} > max_model_len "
                                 f"{self.max_model_len}")
        if not 0 <= first_token < self.lm.vocab_size:
            raise InvalidRequest(f"first_token {first_token} is outside the vocabulary")
        try:
            self._runner.check_prefill(kv, prompt_len)
        except ValueError as exc:
            raise InvalidRequest(str(exc), code="invalid_kv") from exc
        decode = self._decoders[params.skip_special_tokens]
        detokenizer = IncrementalDetokenizer(self.tokenizer, decode=decode)
        stream = DecodeStream(request_id, self.stream_timeout)
        return DecodeRequest(request_id, kv, prompt_len, int(rope_delta), first_token, params, max_tokens,
                             self.lm.eos_token_ids, detokenizer, stream, on_event, prompt_token_ids)

    # ---- worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
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
            self._step()

    def _has_work(self) -> bool:
        can_admit = bool(self._waiting) and len(self._rows) < self.num_slots
        return self._closed or bool(self._inbox or self._aborts or self._rows) or can_admit

    def _take(self, inbox: list[DecodeRequest]) -> None:
        """New requests: judge the first token now; those that go on wait for a slot."""
        for request in inbox:
            if self._emit_token(request, request.first_token) is None:
                self._waiting.append(request)

    def _apply_aborts(self, aborts: set[str]) -> None:
        for request_id in aborts:
            request = self._requests.get(request_id)
            if request is None or request.finished:
                continue
            if request in self._rows:
                self._release(self._rows.index(request))
            elif request in self._waiting:
                self._waiting.remove(request)
            self._end(request, request.end(FINISH_ABORT))

    def _admit(self) -> None:
        while self._waiting and len(self._rows) < self.num_slots:
            request = self._waiting.popleft()
            try:
                self._runner.load(len(self._rows), request.kv)
            except Exception as exc:
                logger.exception("loading the KV of request %s failed", request.request_id)
                self._end(request, request.end(FINISH_ERROR, f"kv load failed: {type(exc).__name__}"))
                continue
            request.kv = None
            self._rows.append(request)

    def _step(self) -> None:
        rows = self._rows
        try:
            tokens = self._runner.step([r.last_token for r in rows], [r.rope_delta for r in rows],
                                       [r.sampling for r in rows])
        except Exception as exc:
            logger.exception("decode step failed; failing %d requests", len(rows))
            self._fail_all(f"decode step failed: {type(exc).__name__}")
            return
        self._steps += 1
        done = [row for row, (request, token) in enumerate(zip(rows, tokens, strict=True))
                if self._emit_token(request, token) is not None]
        for row in reversed(done):   # descending: a moved (last) row is never one still to release
            self._release(row)

    def _emit_token(self, request: DecodeRequest, token: int) -> DecodeEvent | None:
        """Accept and emit one token; returns the final event if the request ended."""
        try:
            event = request.accept(token)
        except Exception as exc:
            logger.exception("processing a token of request %s failed", request.request_id)
            event = request.end(FINISH_ERROR, f"token processing failed: {type(exc).__name__}")
        self._tokens += 1
        if event.finished:
            self._end(request, event)
            return event
        request.emit(event)
        return None

    def _release(self, row: int) -> None:
        """Free `row`; the last active row moves into it so rows stay contiguous."""
        last = len(self._rows) - 1
        self._runner.move(last, row)
        self._rows[row] = self._rows[last]
        self._rows.pop()

    def _end(self, request: DecodeRequest, event: DecodeEvent) -> None:
        # Forget the id first: a consumer may resubmit it as soon as it sees the final event.
        with self._cond:
            self._requests.pop(request.request_id, None)
            self._finished += 1
        request.emit(event)

    def _fail_all(self, message: str) -> None:
        rows, self._rows = self._rows, []
        self._runner.clear(len(rows))
        for request in rows:
            self._end(request, request.end(FINISH_ERROR, message))

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._requests.values())
        self._rows, self._waiting = [], deque()
        for request in pending:
            if not request.finished:
                self._end(request, request.end(FINISH_ABORT, "decode engine closed"))
