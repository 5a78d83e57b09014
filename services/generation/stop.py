"""When a request stops, and what text it may stream before that.

Token-level (checked on every output token, the first one from prefill
included): EOS ids (unless ignore_eos) -> "stop" with stop_reason None; a
stop_token_id -> "stop" with stop_reason = that id; the max_tokens-th token ->
"length".  EOS and stop ids count only from min_tokens on (the sampler also
suppresses them before that).

Text-level: stop strings are searched in the decoded text, so one may span
tokens.  The output is cut before the stop string (or after it with
include_stop_str_in_output) and stop_reason is the string.  Text that could be
the start of a stop string is held back until it is safe: at most
max(len(stop)) - 1 characters, and only as many as actually match a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.generation.params import DecodeParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


class StopChecker:
    """Stop state of one request."""

    def __init__(self, params: DecodeParams, eos_token_ids: Sequence[int], max_tokens: int) -> None:
        self.params = params
        self.max_tokens = max_tokens
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = params.stop
        self._held = ""

    def check_token(self, token_id: int, num_output: int) -> tuple[str | None, int | None]:
        """(finish_reason, stop_reason) after the `num_output`-th token `token_id`, or (None, None)."""
        if num_output >= self.params.min_tokens:
            if token_id in self._eos:
                return FINISH_STOP, None
            if token_id in self._stop_ids:
                return FINISH_STOP, token_id
        if num_output >= self.max_tokens:
            return FINISH_LENGTH, None
        return None, None

    def check_text(self, delta: str, num_output: int) -> tuple[str, str | None]:
        """(text safe to stream now, matched stop string or None) for a new text delta."""
        if not self._stops:
            return delta, None
        text = self._held + delta
        matched = self._match(text, num_output)
        if matched is not None:
            return matched
        hold = self._hold_length(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], None

    def flush(self, tail: str, num_output: int) -> tuple[str, str | None]:
        """The request ends: everything still held (plus `tail`), cut at a stop string if one completes."""
        text = self._held + tail
        self._held = ""
        matched = self._match(text, num_output) if self._stops else None
        return matched if matched is not None else (text, None)

    def _match(self, text: str, num_output: int) -> tuple[str, str] | None:
        if num_output < self.params.min_tokens:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._held = ""
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        return text[:end], stop

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
