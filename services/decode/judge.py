"""How an output token is judged: token-level stop, its text, stop strings.  One rule for decode and prefill.

Decode judges every token of a request this way (`DecodeRequest.accept`).  Prefill judges the first token,
which it sampled, the same way when the coordinator asks (`PrefillRequest.first_chunk`): the coordinator can
then send the first token to the client as soon as prefill answers, while decode reads the KV
(docs/architecture.md, "The first token leaves with prefill's answer").  Both build their judge here, from
the same sampling params, EOS ids, token budget and tokenizer, so the two first chunks are the same chunk;
the coordinator checks that they are (`epd_coordinator_first_chunks_total`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from services.decode.detokenizer import IncrementalDetokenizer, decode_function
from services.decode.params import DecodeParams
from services.decode.stop import FINISH_STOP, StopChecker
from services.decode.stream import DecodeEvent


class OutputJudge:
    """The stop state and the incremental text of one request's output."""

    def __init__(self, params: DecodeParams, eos_token_ids: Sequence[int], max_tokens: int,
                 detokenizer: IncrementalDetokenizer) -> None:
        self.params = params
        self.stop = StopChecker(params, eos_token_ids, max_tokens)
        self.detokenizer = detokenizer

    def judge(self, token_id: int, count: int) -> tuple[str, str | None, int | str | None]:
        """(text, finish_reason, stop_reason) of the `count`-th output token `token_id`."""
        finish, stop_reason = self.stop.check_token(token_id, count)
        reason: int | str | None = stop_reason
        # A stop/EOS token's own text is not part of the output (vLLM), unless asked for.
        skip_text = finish == FINISH_STOP and not self.params.include_stop_str_in_output
        text, matched = self.stop.check_text("" if skip_text else self.detokenizer.push(token_id), count)
        if matched is None and finish is not None:
            tail, matched = self.stop.flush(self.detokenizer.flush(), count)
            text += tail
        if matched is not None:
            finish, reason = FINISH_STOP, matched
        return text, finish, reason


def token_budget(prompt_len: int, params: DecodeParams, max_model_len: int) -> int | None:
    """The request's output token budget (decode's rule), or None when the prompt leaves no room for it."""
    if not 1 <= prompt_len < max_model_len:
        return None
    max_tokens = params.max_tokens or max_model_len - prompt_len
    return max_tokens if prompt_len + max_tokens <= max_model_len else None


class FirstTokenJudge:
    """Prefill's side: the first token's event as decode's first event will be (no logprobs: those stay decode's)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, tuple(eos_token_ids), max_model_len
        self._decoders: dict[bool, Callable[[list[int]], str]] = {
            skip: decode_function(tokenizer, skip) for skip in (True, False)}

    def first_event(self, request_id: str, token_id: int, prompt_len: int, params: DecodeParams) -> DecodeEvent | None:
        """The event, or None where prefill does not judge (logprobs asked, or a budget decode would refuse)."""
        budget = token_budget(prompt_len, params, self.max_model_len)
        if params.logprobs is not None or budget is None:
            return None
        detokenizer = IncrementalDetokenizer(self.tokenizer, decode=self._decoders[params.skip_special_tokens])
        text, finish, reason = OutputJudge(params, self.eos_token_ids, budget, detokenizer).judge(token_id, 1)
        return DecodeEvent(request_id, [token_id], text, finish, reason, 1)
