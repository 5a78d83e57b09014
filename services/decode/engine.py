"""The decode engine: continuous batching over a paged KV block pool.

Who calls what: the decode serving core calls `reserve` (any thread) for a request's share of
the block pool, fills it with `RequestBlocks.load` straight from the KV store's view (one copy),
then `submit` with what prefill handed over (rope_delta, the first sampled token) and reads the
returned `DecodeStream`; `abort`, `stats` and `close` likewise.  `submit` also takes a KV
tensor [num_layers, 2, num_kv_heads, prompt_len, head_dim] and does reserve + load itself
(EngineFull when the pool has no room).

`submit` emits the first token at once, on the caller's thread (it goes through the stop checks
there, so max_tokens=1 or an EOS first token ends without a row and never waits for a step).
One worker thread runs the loop (services/decode/step_loop.py): between steps it takes new requests,
applies aborts and admits waiting ones into free rows; a step is one paged forward for all active rows
(services/decode/paged_forward.py), whose attention reads only each row's own blocks, so a step costs
the sum of the rows' lengths; a failing step is put down to the rows that cause it.

Memory: one `BlockPool` of `kv_cache_bytes`.  A request reserves ceil((prompt_len + max_tokens
- 1) / block_size) blocks at `reserve` and holds only the blocks its tokens fill; running and
waiting requests count in the same pool, and nothing is kept on the heap.  Whatever ends a
request returns its blocks.  Capacity: num_slots running plus `max_queued` waiting; beyond
that, or when the pool cannot promise the blocks, `submit` raises EngineFull.  A request must
fit: prompt_len + max_tokens <= max_model_len (ContextTooLong otherwise); max_tokens=None
means exactly that much.
"""

from __future__ import annotations

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
from services.decode.step_loop import StepLoop
from services.decode.stream import DecodeEvent, DecodeStream
from services.generation.detokenizer import IncrementalDetokenizer, decode_function
from services.generation.judge import token_budget
from services.generation.params import DecodeParams
from services.generation.stop import FINISH_ABORT, FINISH_ERROR
from services.models.base import LanguageModel
from services.protocol.errors import InvalidRequest
from services.sampling.sampler import Sampler


class DecodeEngine(SampleGroups, StepLoop):
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
                               self._runner.screen.kernel if self._runner.screen is not None else "",
                               float(getattr(self._runner, "yielded_s", 0.0)))

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


def _block_bytes(lm: LanguageModel, block_size: int) -> int:
    from services.decode.block_pool import block_bytes

    return block_bytes(lm.layout, block_size)
