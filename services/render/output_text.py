"""Output token ids -> the text decode would have streamed for them, resumable across calls.

Derender must give exactly the text epd's own decode produces, so it runs the
same machinery: decode's IncrementalDetokenizer and StopChecker, fed token by
token the way `DecodeRequest.accept` feeds them.  What decode learns from its
own sampling (did this token end the request, and why) comes here from the
generate answer's finish_reason / stop_reason, so no EOS ids are needed:

- a token that ended the request with "stop" and no stop string (EOS, or a
  stop token id) shows no text unless include_stop_str_in_output;
- on "stop" or "length" the held-back text is flushed (and cut at a stop
  string, if one completes there); "abort" and "error" flush nothing.

`state()` / `from_state()` turn the few values in flight (detokenizer window,
held stop-string prefix, tokens seen) into JSON, which is what a streaming
derender caller carries between calls as `stream_state`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.generation.detokenizer import IncrementalDetokenizer
from services.generation.params import DecodeParams
from services.generation.stop import FINISH_LENGTH, FINISH_STOP, StopChecker

_FLUSHING = (FINISH_STOP, FINISH_LENGTH)


class OutputText:
    """Text of one output sequence, fed in chunks of token ids."""

    def __init__(self, tokenizer: Any, params: DecodeParams) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        # max_tokens is never reached here: the generate answer says when the output ended.
        self.stop = StopChecker(params, (), max_tokens=2**62)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def feed(self, token_ids: Sequence[int], finish_reason: str | None = None,
             stop_reason: int | str | None = None) -> str:
        """Text completed by `token_ids`; `finish_reason` set when these are the last ones."""
        if self.finish_reason is not None:
            return ""  # nothing follows the end (as in decode)
        pieces = []
        for index, token in enumerate(token_ids):
            pieces.append(self._accept(token, finish_reason if index == len(token_ids) - 1 else None,
                                       stop_reason))
            if self.finish_reason is not None:
                break
        if not token_ids and finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason  # ended from outside (abort)
        return "".join(pieces)

    def _accept(self, token: int, finish: str | None, stop_reason: int | str | None) -> str:
        self.num_tokens += 1
        count = self.num_tokens
        token_stop = finish == FINISH_STOP and not isinstance(stop_reason, str)
        skip_text = token_stop and not self.params.include_stop_str_in_output
        text, matched = self.stop.check_text("" if skip_text else self.detokenizer.push(token), count)
        if matched is None and finish in _FLUSHING:
            tail, matched = self.stop.flush(self.detokenizer.flush(), count)
            text += tail
        if matched is not None:
            finish, stop_reason = FINISH_STOP, matched
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, stop_reason
        return text

    # ---- carried state (streaming derender) -------------------------------------------------------
    # The detokenizer and stop checker keep their state private; this is the one place that reads and
    # restores it, so a change there shows up in this module's tests.

    def state(self) -> dict[str, Any]:
        d = self.detokenizer
        return {"window": list(d._window), "read": d._read, "held": self.stop._held,  # noqa: SLF001
                "num_tokens": self.num_tokens, "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason}

    @classmethod
    def from_state(cls, tokenizer: Any, params: DecodeParams, state: dict[str, Any] | None) -> OutputText:
        out = cls(tokenizer, params)
        if state:
            d = out.detokenizer
            d._window, d._read, d._prefix_text = list(state["window"]), state["read"], None  # noqa: SLF001
            out.stop._held = state["held"]  # noqa: SLF001
            out.num_tokens = state["num_tokens"]
            out.finish_reason, out.stop_reason = state["finish_reason"], state["stop_reason"]
        return out


def text_params(stop: Sequence[str] = (), *, min_tokens: int = 0, skip_special_tokens: bool = True,
                include_stop_str_in_output: bool = False) -> DecodeParams:
    """The DecodeParams fields that shape output text (the rest do not matter here)."""
    return DecodeParams(stop=tuple(stop), min_tokens=min_tokens, skip_special_tokens=skip_special_tokens,
                        include_stop_str_in_output=include_stop_str_in_output)
