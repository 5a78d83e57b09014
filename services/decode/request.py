"""One decode request inside the engine: its output so far and how each new token is judged.

Created by `DecodeEngine.submit`; from then on touched only by the engine's
worker thread.  `accept(token)` runs the same path for the first token (from
prefill) and for every sampled one: record, then judge it (services/decode/judge.py:
token-level stop, detokenize, stop strings); it returns the event to emit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from services.decode.detokenizer import IncrementalDetokenizer
from services.decode.judge import OutputJudge
from services.decode.params import DecodeParams
from services.decode.request_blocks import RequestBlocks
from services.decode.sampler import RowSampling
from services.decode.stream import DecodeEvent, DecodeStream

logger = logging.getLogger(__name__)


class DecodeRequest:
    def __init__(self, request_id: str, blocks: RequestBlocks, prompt_len: int, rope_delta: int, first_token: int,
                 params: DecodeParams, max_tokens: int, eos_token_ids: Sequence[int],
                 detokenizer: IncrementalDetokenizer, stream: DecodeStream,
                 on_event: Callable[[DecodeEvent], None] | None = None,
                 prompt_token_ids: Sequence[int] | None = None) -> None:
        self.request_id = request_id
        self.blocks = blocks          # its KV in the pool; released when the request ends
        self.prompt_len = prompt_len
        self.rope_delta = rope_delta
        self.first_token = first_token
        self.params = params
        self.sampling = RowSampling(params, eos_token_ids, prompt_token_ids)
        self.judge = OutputJudge(params, eos_token_ids, max_tokens, detokenizer)
        self.stream = stream
        self.on_event = on_event
        self.output_ids: list[int] = []
        self.last_token = first_token
        self.finished = False
        self.started = False       # queued for steps (`DecodeEngine.start`); before that its KV may be loading
        self.abort_asked = False   # an abort that came before `start`: applied there

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    def accept(self, token_id: int) -> DecodeEvent:
        """Take the next output token; the returned event says whether the request ends here."""
        self.output_ids.append(token_id)
        self.sampling.record(token_id)
        self.last_token = token_id
        text, finish, reason = self.judge.judge(token_id, len(self.output_ids))
        record = self.sampling.take_logprobs()  # None for the first token (prefill sampled it) and when not asked
        return self._event([token_id], text, finish, reason, logprobs=None if record is None else [record])

    def replay(self, token_ids: Sequence[int]) -> DecodeEvent | None:
        """Take tokens a client already has (a resumed request): judged as `accept` judges them, so the stop
        state, the held text and the counts go on where they were, but not emitted.  Should they end the
        request after all, the final event (with no tokens: the client has them) is returned."""
        for token_id in token_ids:
            event = self.accept(token_id)
            if event.finished:
                return self._event([], "", event.finish_reason, event.stop_reason)
        return None

    def end(self, finish_reason: str, error: str | None = None) -> DecodeEvent:
        """The final event of a request that ends from outside (abort, error, shutdown)."""
        return self._event([], "", finish_reason, None, error)

    def emit(self, event: DecodeEvent) -> None:
        self.finished = self.finished or event.finished
        self.stream.put(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a consumer's bug must not stop the engine
                logger.exception("on_event callback failed for request %s", self.request_id)

    def _event(self, token_ids: list[int], text: str, finish: str | None, stop_reason: int | str | None,
               error: str | None = None, logprobs: list | None = None) -> DecodeEvent:
        return DecodeEvent(self.request_id, token_ids, text, finish, stop_reason, len(self.output_ids), error,
                           logprobs)
