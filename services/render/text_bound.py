"""Refuse prompt text that cannot fit the context before tokenizing all of it (megabytes take seconds).

Two cheap tests run on the text of a request (every message's text, or a
completion prompt) once it is longer than the context could hold at a few
bytes per token:

1. tokenize only a prefix, PREFIX_BYTES_PER_TOKEN bytes per context token:
   if that prefix alone has more tokens than the context (plus a margin for
   the tokens a cut can split), the whole text cannot fit;
2. the text has more bytes than the context times the longest token of the
   vocabulary (twice, for normalization that shrinks text): no tokenization
   can bring it under the context.

Either way the answer is the usual 400 `context_length_exceeded`, at once;
text that passes both is tokenized as always and checked exactly.
Who calls what: RenderService before templating (render_chat, render_completion).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from services.protocol.errors import InvalidRequest

PREFIX_BYTES_PER_TOKEN = 4
CUT_MARGIN_TOKENS = 64


def longest_token_bytes(vocab: Iterable[str]) -> int:
    """Bytes of the longest vocabulary entry (as UTF-8 of its spelling: never less than the bytes it covers)."""
    return max((len(token.encode("utf-8")) for token in vocab), default=1)


def needs_count(texts: Iterable[str], max_model_len: int) -> bool:
    """Whether `check_text_fits` would tokenize anything: text this short fits whatever its tokens."""
    return sum(len(t) + 1 for t in texts if t) > max_model_len * PREFIX_BYTES_PER_TOKEN + 1


def check_text_fits(texts: Iterable[str], max_model_len: int, longest_token: int,
                    count_tokens: Callable[[str], int]) -> None:
    text = "\n".join(t for t in texts if t)
    cheap = max_model_len * PREFIX_BYTES_PER_TOKEN
    if len(text) <= cheap:  # chars <= bytes: nothing to decide early
        return
    size = len(text.encode("utf-8"))
    prefix_tokens = count_tokens(text[:cheap])
    if prefix_tokens > max_model_len + CUT_MARGIN_TOKENS or size > 2 * max_model_len * longest_token:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, the prompt text is "
            f"{size} bytes, more tokens than that (its first {cheap} characters alone are {prefix_tokens} "
            "tokens).", code="context_length_exceeded")


def message_texts(messages: Iterable[dict[str, Any]]) -> list[str]:
    """The text of normalized chat messages (string contents and text parts)."""
    texts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return texts
