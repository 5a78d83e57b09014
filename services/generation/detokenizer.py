"""Incremental detokenization: text deltas whose concatenation is `tokenizer.decode(all_ids)`.

Scheme (as vLLM's detokenize_incrementally and TGI): keep a short window of
ids starting at `prefix` (a few tokens of context, so decoders that depend on
the first token, e.g. SentencePiece's leading space, behave as in a full
decode) with `read` marking what was already emitted.  Each push decodes
window[prefix:read] and window[prefix:], and emits the difference unless the
text ends in U+FFFD: byte-level BPE splits a UTF-8 character across tokens,
so a trailing replacement char may still complete with the next token.
`flush()` emits what is still held when the request ends.  The window is
trimmed on every emit, so a step costs O(new tokens), not O(output).

Ids outside the tokenizer (the model vocab is larger, e.g. 151936 vs 151657)
decode to nothing, as in a full decode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REPLACEMENT = "\ufffd"


def decode_function(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode` with fixed options, calling the Rust backend directly when that is the same."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # transformers' TokenizersBackend.decode is backend.decode plus an optional space clean-up.
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas for one request."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self._decode = decode or decode_function(tokenizer, skip_special_tokens)
        self._num_known = len(tokenizer)
        self._window: list[int] = []   # ids from the prefix offset on
        self._read = 0                 # window index of the first id not yet emitted
        self._prefix_text: str | None = None

    def push(self, token_id: int) -> str:
        """Add one id; returns the text it completes ("" while a character is still split)."""
        if not 0 <= token_id < self._num_known:
            return ""
        self._window.append(token_id)
        prefix_text = self._prefix()
        text = self._decode(self._window)
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text, prefix_text)

    def flush(self) -> str:
        """Everything still held back (e.g. an incomplete character at the very end)."""
        if self._read == len(self._window):
            return ""
        prefix_text = self._prefix()
        text = self._decode(self._window)
        if len(text) <= len(prefix_text):
            return ""
        return self._advance(text, prefix_text)

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        return self._prefix_text

    def _advance(self, text: str, prefix_text: str) -> str:
        # The emitted ids become the next prefix: drop everything before them.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = None
        return text[len(prefix_text):]
