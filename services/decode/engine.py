"""The decode engine: continuous batching over a paged KV block pool.

Who calls what: the decode serving core calls `reserve` (any thread) for a request's share of
the block pool, fills it with `RequestBlocks.load` straight from the KV store's view (one copy),
then `submit` with what prefill handed over (rope_delta, the first sampled token) and reads the
returned `DecodeStream`; `abort`, `stats` and `close` likewise.  `submit` also takes a KV
tensor [num_layers, 2, num_kv_heads, prompt_len, head_dim] and does reserve + load itself
(EngineFull when the pool has no room).

`submit` emits the first token at once, on the caller's thread (it goes through the stop checks
there, so max_tokens=1 or an EOS first token ends without a row and never waits for a step).
One worker thread runs the loop.  Between steps it takes the new requests that go on, applies
aborts, and admits waiting requests into free rows (FIFO, at most `num_slots` rows).
A step is one paged forward for all active rows (services/decode/paged_forward.py); a row's
attention reads only its own blocks, so a step costs the sum of the rows' lengths.  Active
requests occupy rows 0..n-1; a leaving request's row is filled by the last one (its block
table row moves, its KV does not).  An exception in a step is put down to the rows that cause it:
the step runs again for each row alone, and only a row that fails alone ends (finish_reason "error");
the others take the tokens their own steps gave and carry on.

Memory: one `BlockPool` of `kv_cache_bytes`.  A request reserves ceil((prompt_len + max_tokens
- 1) / block_size) blocks at `reserve` and holds only the blocks its tokens fill; running and
waiting requests count in the same pool, and nothing is kept on the heap.  Whatever ends a
request returns its blocks.  Capacity: num_slots running plus `max_queued` waiting; beyond
that, or when the pool cannot promise the blocks, `submit` raises EngineFull.  A request must
fit: prompt_len + max_tokens <= max_model_len (ContextTooLong otherwise); max_tokens=None
means exactly that much.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.decode.errors import ContextTooLong, EngineClosed, EngineFull
from services.decode.fork import group_blocks
from services.decode.metrics import EngineStats
from services.decode.request import DecodeRequest
from services.decode.request_blocks import RequestBlocks
from services.decode.runner import StepReport
from services.decode.runners import make_pool, make_runner
from services.decode.samples import SampleGroup, SampleGroups
from services.decode.stream import DecodeEvent, DecodeStream
from services.generation.detokenizer import IncrementalDetokenizer, decode_function
from services.generation.judge import token_budget
from services.generation.params import DecodeParams
from services.generation.stop import FINISH_ABORT, FINISH_ERROR
from services.models.base import LanguageModel
from services.protocol.errors import InvalidRequest
from services.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5   # the worker re-checks its flags at least this often when idle


class DecodeEngine(SampleGroups):
    def __init__(self, lm: LanguageModel, tokenizer: Any, num_slots: int, max_model_len: int,
                 max_queued: int | None = None, stream_timeout: float | None = 60.0,
                 seed: int | None = None, kv_cache_bytes: int | None = None, block_size: int = 16,
                 attention: str = "auto", serial_rows: int = 0, fused: str = "auto",
                 fused_serial_rows: int | None = None, lm_head_screen: str = "auto",
                 graph_buckets: Sequence[int] | None = None, logprobs_mode: str = "raw_logprobs") -> None:
        if num_slots < 1 or max_model_len < 2:
            raise ValueError(f"need num_slots >= 1 and max_model_len >= 2, got {num_slots}, {max_model_len}")
        if max_model_len > lm.layout.max_model_len:
            raise ValueError(f"max_model_len {max_model_len} > the model's {lm.layout.max_model_len}")
        self.lm, self.tokenizer = lm, tokenizer
        self.num_slots, self.max_model_len = num_slots, max_model_len
        self.max_queued = 4 * num_slots if max_queued is None else max_queued
        self.stream_timeout = stream_timeout
        if kv_cache_bytes is None:  # room for every slot at full length, as a preallocated engine had
            kv_cache_bytes = num_slots * -(-max_model_len // block_size) * _block_bytes(lm, block_size)
        self.pool = make_pool(lm, kv_cache_bytes, block_size, attention)   # CPU or CUDA: services/decode/runners.py
        self._runner = make_runner(lm, self.pool, num_slots, max_model_len, Sampler(seed, logprobs_mode), attention,
                                   serial_rows, fused, fused_serial_rows, lm_head_screen, graph_buckets)
        self._bytes_copied = 0
        self._decoders = {skip: decode_function(tokenizer, skip) for skip in (True, False)}
        self._cond = threading.Condition()
        self._requests: dict[str, DecodeRequest] = {}   # every request (sample) not yet finished, by key
        self._groups: dict[str, SampleGroup] = {}         # requests for n > 1 samples, by request id
        self._inbox: deque[DecodeRequest] = deque()
        self._aborts: set[str] = set()
        self._waiting: deque[DecodeRequest] = deque()
        self._rows: list[DecodeRequest] = []
        self._closed = False
        self._steps = self._tokens = self._finished = 0
        self._poison = os.environ.get("EPD_FAKE_DECODE_POISON", "")   # FAKE (tests only): see _forward
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    # ---- API (any thread) -------------------------------------------------------------------

    def reserve(self, prompt_len: int, params: DecodeParams | None = None, samples: int = 1) -> RequestBlocks | None:
        """The blocks a request of `prompt_len` tokens can ever need, promised now; None if the pool cannot.
        With `samples` > 1: the prompt's blocks once and each sample's own (services/decode/fork.py).

        Raises ContextTooLong when prompt_len + max_tokens exceeds max_model_len.  The caller owns the
        result until `submit` (or `open_samples`) takes it, and must `release()` it if it never does."""
        max_tokens = self._max_tokens(prompt_len, params or DecodeParams())
        count = (self.pool.blocks_for(prompt_len + max_tokens - 1) if samples == 1
                 else group_blocks(self.pool, prompt_len, max_tokens, samples))
        return RequestBlocks(self.pool, count) if self.pool.try_reserve(count) else None

    def submit(self, request_id: str, kv: torch.Tensor | RequestBlocks, prompt_len: int, rope_delta: int,
               first_token: int, params: DecodeParams | None = None,
               on_event: Callable[[DecodeEvent], None] | None = None,
               prompt_token_ids: Sequence[int] | None = None) -> DecodeStream:
        """Queue a prefilled request (its KV in loaded `RequestBlocks`, or as a tensor to load now); its
        events (the first token's included) arrive on the stream.  On any error the blocks are released."""
        request = self.open(request_id, kv, prompt_len, rope_delta, first_token, params, on_event,
                            prompt_token_ids, loaded=True)
        self.start(request)
        return request.stream

    def open(self, request_id: str, kv: torch.Tensor | RequestBlocks, prompt_len: int, rope_delta: int,
             first_token: int, params: DecodeParams | None = None,
             on_event: Callable[[DecodeEvent], None] | None = None, prompt_token_ids: Sequence[int] | None = None,
             loaded: bool = False, resumed: Sequence[int] = ()) -> DecodeRequest:
        """`submit` in two halves, for a caller that loads the KV after the first token is out: the request
        is registered and its first token emitted now, on reserved (not yet loaded) blocks; `start` queues
        it for steps once the blocks hold the prompt (or `fail` ends it).  Until then it takes no row, and an
        abort ends it only at `start`/`fail`, so its blocks are never freed while the caller writes them.
        If the first token ends the request (`request.finished`), the blocks are already released and
        nothing must be loaded.  `resumed`: the output tokens a client already has (their last is `first_token`,
        the KV holds the prompt and the others): judged again, not emitted; the first event is the next token."""
        params = params or DecodeParams()
        blocks = kv if isinstance(kv, RequestBlocks) else None
        try:
            request = self._build(request_id, kv, prompt_len, rope_delta, first_token, params, on_event,
                                  prompt_token_ids, loaded, len(resumed))
            blocks = request.blocks
            with self._cond:
                self._check_accept(request_id)
                self._requests[request_id] = request
        except BaseException:
            if blocks is not None:
                blocks.release()
            raise
        # The first token (prefill sampled it) is judged and emitted here, on the caller's thread, so
        # its event never waits for the step the worker thread is in the middle of (up to one TPOT).
        # Under the lock: an abort of this id cannot end the request while its first token is judged.
        with self._cond:
            if resumed:
                final = request.replay(resumed)
                if final is not None:
                    self._end(request, final)
            else:
                self._emit_token(request, request.first_token)
        return request

    def start(self, request: DecodeRequest | SampleGroup) -> None:
        """Queue an opened request for steps (its blocks now hold the prompt); a request that ended meanwhile
        (its first token, or an abort asked for while it was loading) is ended here instead.  A group's
        samples still running share the loaded prompt (fork.fork) and are queued each on its own."""
        if isinstance(request, SampleGroup):
            self._start_samples(request)
            return
        if not request.finished and request.blocks.num_tokens != request.prompt_len:
            self.fail(request, f"the loaded KV holds {request.blocks.num_tokens} tokens, prompt_len is "
                               f"{request.prompt_len}")
            return
        with self._cond:
            request.started = True
            if request.finished:
                return
            if not request.abort_asked:
                self._inbox.append(request)
                self._cond.notify()
                return
        self._end(request, request.end(FINISH_ABORT))

    def fail(self, request: DecodeRequest | SampleGroup, message: str) -> None:
        """End an opened request that will not start (its KV could not be loaded): an error event, blocks back."""
        if isinstance(request, SampleGroup):
            request.started = True
            request.blocks.release()
            for member in request.members:
                self.fail(member, message)
            return
        with self._cond:
            request.started = True
            if request.finished:
                return
        self._end(request, request.end(FINISH_ERROR, message))

    def _check_accept(self, request_id: str, samples: int = 1) -> None:
        if self._closed:
            raise EngineClosed("the decode engine is closed")
        if request_id in self._requests or request_id in self._groups:
            raise InvalidRequest(f"request {request_id!r} is already being decoded", code="duplicate_request")
        if len(self._requests) + samples > self.num_slots + self.max_queued:
            raise EngineFull(f"decode is full: {self.num_slots} slots busy, {self.max_queued} waiting")

    def abort(self, request_id: str) -> bool:
        """Ends the request before the next step (finish_reason "abort"); False if it is not running."""
        with self._cond:
            group = self._groups.get(request_id)
            if group is not None:
                self._aborts.update(member.key for member in group.members)
            elif request_id in self._requests:
                self._aborts.add(request_id)
            else:
                return False
            self._cond.notify()
            return True

    @property
    def busy(self) -> bool:
        """A request (or a sample of one) is open: registered and not yet ended."""
        with self._cond:
            return bool(self._requests)

    def stats(self) -> EngineStats:
        with self._cond:
            active = len(self._rows)
            return EngineStats(self.num_slots, active, len(self._requests) - active, self._steps,
                               self._tokens, self._finished, self.pool.stats(), self._bytes_copied,
                               self._runner.attention_kernel, self._runner.step_mode,
                               self._runner.serial_steps, *self._runner.screen_counts,
                               self._runner.screen.kernel if self._runner.screen is not None else "")

    @property
    def graph_replays(self) -> int:
        """Steps that replayed a captured CUDA graph (0 on CPU)."""
        return int(getattr(self._runner, "graph_replays", 0))

    @property
    def step_report(self) -> StepReport:
        """How the step runs, fused or eager, and why (services/decode/runner.py)."""
        return self._runner.step_report

    def describe(self) -> str:
        """One line for the start-up log: pool, kernel, step mode (with the per-bucket choice and timings)."""
        kv, stats = self.pool.stats(), self.stats()
        return (f"{kv.num_blocks} KV blocks of {kv.block_size} tokens ({kv.num_blocks * kv.block_bytes / 2**20:.0f} "
                f"MiB), {self.num_slots} rows, attention {stats.attention_kernel}, {self._runner.threads} threads "
                f"(steps of <= {self._runner.serial_rows} rows on 1); {self.step_report.line()}; "
                f"{self._runner.screen_report.line()}")

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

    def _max_tokens(self, prompt_len: int, params: DecodeParams) -> int:
        budget = token_budget(prompt_len, params, self.max_model_len)
        if budget is not None:
            return budget
        if not 1 <= prompt_len < self.max_model_len:
            raise ContextTooLong(f"prompt_len {prompt_len} must be in [1, {self.max_model_len - 1}]")
        raise ContextTooLong(f"prompt_len {prompt_len} + max_tokens {params.max_tokens} > max_model_len "
                             f"{self.max_model_len}")

    def _build(self, request_id: str, kv: torch.Tensor | RequestBlocks, prompt_len: int, rope_delta: int,
               first_token: int, params: DecodeParams, on_event: Callable[[DecodeEvent], None] | None,
               prompt_token_ids: Sequence[int] | None, loaded: bool = True, num_resumed: int = 0) -> DecodeRequest:
        max_tokens = self._max_tokens(prompt_len - max(0, num_resumed - 1), params)   # from the original prompt
        if not 0 <= first_token < self.lm.vocab_size:
            raise InvalidRequest(f"first_token {first_token} is outside the vocabulary")
        blocks = kv if isinstance(kv, RequestBlocks) else self._load(kv, prompt_len, params)
        if loaded and blocks.num_tokens != prompt_len:
            raise InvalidRequest(f"the loaded KV holds {blocks.num_tokens} tokens, prompt_len is {prompt_len}",
                                 code="invalid_kv")
        decode = self._decoders[params.skip_special_tokens]
        detokenizer = IncrementalDetokenizer(self.tokenizer, decode=decode)
        stream = DecodeStream(request_id, self.stream_timeout)
        return DecodeRequest(request_id, blocks, prompt_len, int(rope_delta), first_token, params, max_tokens,
                             self.lm.eos_token_ids, detokenizer, stream, on_event, prompt_token_ids)

    def check_prefill(self, kv: Any, prompt_len: int) -> None:
        """InvalidRequest unless `kv` is a KV tensor of `prompt_len` tokens in the model's layout and dtype."""
        try:
            self._runner.check_prefill(kv, prompt_len)
        except ValueError as exc:
            raise InvalidRequest(str(exc), code="invalid_kv") from exc

    def load(self, blocks: RequestBlocks, kv: torch.Tensor, prompt_len: int) -> None:
        """Check `kv` and copy it into `blocks` (the one copy of the hand-off); any thread."""
        self.check_prefill(kv, prompt_len)
        blocks.load(kv)
        with self._cond:
            self._bytes_copied += blocks.bytes_copied

    def _load(self, kv: torch.Tensor, prompt_len: int, params: DecodeParams) -> RequestBlocks:
        self.check_prefill(kv, prompt_len)
        blocks = self.reserve(prompt_len, params)
        if blocks is None:
            stats = self.pool.stats()
            raise EngineFull(f"decode KV pool is full: {stats.free_blocks} of {stats.num_blocks} blocks free")
        try:
            self.load(blocks, kv, prompt_len)
        except BaseException:
            blocks.release()
            raise
        return blocks

    # ---- worker thread ----------------------------------------------------------------------

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


def _block_bytes(lm: LanguageModel, block_size: int) -> int:
    from services.decode.block_pool import block_bytes

    return block_bytes(lm.layout, block_size)
