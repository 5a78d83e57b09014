"""Prompt logprobs (vLLM's `prompt_logprobs`): computed by prefill, from the rows of the prompt's own forward.

A prompt that asks (sampling prompt_logprobs = n, 0..20) has every row's final hidden state kept
(packing.forward_rows) and put through the LM head, a few rows at a time (a row of logits is the
vocabulary wide); row r predicts prompt token r + 1, so each prompt token but the first gets a record:
its logprob and rank, and the n most likely tokens.  The prompt runs whole (no prefix-cache hit: the
rows of a hit are not computed, vLLM skips the cache too), and the values are the raw distribution
(vLLM: processed and raw are the same for prompt tokens; the logits modes report logits).

The answer is vLLM's shape: one entry per prompt token, None for the first, else
{token id: {"logprob", "rank", "decoded_token"}} with the prompt's token first and then the top n (a dict:
a prompt token among the top n appears once, with its rank in the top n), logprobs floored at -9999.0.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.protocol.logprobs import TokenLogprob, floor

if TYPE_CHECKING:
    import torch

ROWS_PER_HEAD = 32   # rows through the LM head at once: bounds the [rows, vocab] logits in memory


def chunk_records(head: Any, hidden: torch.Tensor, token_ids: list[int], start: int, count: int,
                  mode: str) -> list[TokenLogprob]:
    """Records of the prompt tokens rows [start, start + len(hidden)) predict (the ones inside the prompt)."""
    import torch

    from services.sampling.token_logprobs import gather

    rows = min(len(hidden), len(token_ids) - 1 - start)   # the prompt's last row predicts an output token
    out: list[TokenLogprob] = []
    for first in range(0, rows, ROWS_PER_HEAD):
        end = min(rows, first + ROWS_PER_HEAD)
        logits = head(hidden[first:end]).float()
        values = logits if mode.endswith("logits") else torch.log_softmax(logits, dim=-1)
        targets = token_ids[start + first + 1:start + end + 1]
        out.extend(gather(values, targets, [count] * len(targets)))
    return out


class TokenTexts:
    """Token id -> its text (`tokenizer.decode([id])`, as vLLM's per-id decode), the tokenizer loaded once, lazily."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._decode: Any = None
        self._lock = threading.Lock()

    def __call__(self, token_id: int) -> str | None:
        if self.path is None:
            return None
        with self._lock:
            if self._decode is None:
                from services.models.processing import load_tokenizer

                tokenizer = load_tokenizer(self.path)
                self._decode = lambda i: tokenizer.decode([i])
        return self._decode(token_id)


def answer(records: list[TokenLogprob], texts: TokenTexts) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then one dict per record (module docstring)."""
    out: list[dict[str, Any] | None] = [None]
    for record in records:
        entry = {str(record.token_id): _logprob(record.logprob, record.rank, texts(record.token_id))}
        for rank, (token, value) in enumerate(zip(record.top_ids, record.top_logprobs, strict=True), 1):
            entry[str(token)] = _logprob(value, rank, texts(token))
        out.append(entry)
    return out


def _logprob(value: float, rank: int, text: str | None) -> dict[str, Any]:
    return {"logprob": floor(value), "rank": rank, "decoded_token": text}
