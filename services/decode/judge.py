"""How an output token is judged: token-level stop, its text, stop strings, and the output's token budget.

Decode judges every token of a request this way (`DecodeRequest.accept`), and judges again the tokens a
resumed request's client already has (`DecodeRequest.replay`), so its stop state and text go on exactly where
the failed instance left them.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.decode.detokenizer import IncrementalDetokenizer
from services.decode.params import DecodeParams
from services.decode.stop import FINISH_STOP, StopChecker


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
