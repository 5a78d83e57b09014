"""Repetition, presence and frequency penalties (vLLM semantics), one request at a time.

The repetition penalty applies to every token seen in the prompt or the
output (divide positive logits, multiply negative ones); presence and
frequency penalties apply to output tokens only.  State is a count per vocab
id, allocated on first use, so requests without penalties cost nothing.
Work per step is O(vocab) for a penalised row, never O(context).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.decode.params import DecodeParams


class PenaltyState:
    """Output token counts (and the prompt's token set) of one request."""

    def __init__(self, params: DecodeParams, prompt_token_ids: Sequence[int] | None = None) -> None:
        self.params = params
        self._prompt_ids = list(prompt_token_ids or ()) if params.repetition_penalty != 1.0 else []
        self._pending: list[int] = []     # tokens recorded before the vocab size was known
        self._counts: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None

    def record(self, token_id: int) -> None:
        if self._counts is None:
            self._pending.append(token_id)
        elif 0 <= token_id < self._counts.shape[0]:
            self._counts[token_id] += 1
            self._seen[token_id] = True

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise one row of logits [vocab] in place."""
        if self._counts is None:
            self._allocate(logits.shape[0], logits.device)
        p = self.params
        if p.repetition_penalty != 1.0:
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits.copy_(torch.where(self._seen, scaled, logits))
        if p.frequency_penalty != 0.0:
            logits.sub_(self._counts * p.frequency_penalty)
        if p.presence_penalty != 0.0:
            logits.sub_((self._counts > 0).to(logits.dtype) * p.presence_penalty)

    def _allocate(self, vocab: int, device: torch.device) -> None:
        self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        # `_seen` covers prompt and output: what the repetition penalty looks at.
        self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = [t for t in self._prompt_ids if 0 <= t < vocab]
        if prompt:
            self._seen[torch.tensor(prompt, device=device)] = True
        pending, self._pending = self._pending, []
        for token_id in pending:
            self.record(token_id)
