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

from services.generation.params import DecodeParams


class _Counts:
    """Output token counts and the seen set (prompt + output) over the vocab."""

    def __init__(self, vocab: int, device: torch.device, prompt_ids: Sequence[int]) -> None:
        # Allocated during a step (inference mode) but updated between steps: must be normal tensors.
        with torch.inference_mode(False):
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = [t for t in prompt_ids if 0 <= t < vocab]
            if prompt:
                self.seen[torch.tensor(prompt, device=device)] = True

    def add(self, token_id: int) -> None:
        if 0 <= token_id < self.counts.shape[0]:
            self.counts[token_id] += 1
            self.seen[token_id] = True


class PenaltyState:
    """The penalty state of one request; `apply` penalises its row of logits."""

    def __init__(self, params: DecodeParams, prompt_token_ids: Sequence[int] | None = None) -> None:
        self.params = params
        self._prompt_ids = list(prompt_token_ids or ()) if params.repetition_penalty != 1.0 else []
        self._pending: list[int] = []     # tokens recorded before the vocab size was known
        self._state: _Counts | None = None

    def record(self, token_id: int) -> None:
        if self._state is None:
            self._pending.append(token_id)
        else:
            self._state.add(token_id)

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise one row of logits [vocab] in place."""
        state = self._state or self._allocate(logits.shape[0], logits.device)
        p = self.params
        if p.repetition_penalty != 1.0:
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits.copy_(torch.where(state.seen, scaled, logits))
        if p.frequency_penalty != 0.0:
            logits.sub_(state.counts * p.frequency_penalty)
        if p.presence_penalty != 0.0:
            logits.sub_((state.counts > 0).to(logits.dtype) * p.presence_penalty)

    def _allocate(self, vocab: int, device: torch.device) -> _Counts:
        state = self._state = _Counts(vocab, device, self._prompt_ids)
        for token_id in self._pending:
            state.add(token_id)
        self._pending = []
        return state
