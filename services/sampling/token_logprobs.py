"""Logprobs of sampled tokens, computed only for the rows of a batch that ask for them, in vLLM's four modes.

`logprobs_mode` (--logprobs-mode, vLLM's names) says which distribution the records report:

- `raw_logprobs` (the default): log_softmax of the logits as the model produced them, before penalties,
  min_tokens suppression and temperature (copied out of the batch before the sampler adjusts it in place);
- `raw_logits`: those logits themselves;
- `processed_logprobs`: log_softmax of the logits the token was drawn from: after penalties and suppression,
  divided by the temperature, with min_p, top-k and top-p applied as masks (-inf) the way vLLM's CPU sampler
  applies them (vllm/v1/sample/ops/topk_topp_sampler.py); a greedy row is not divided or masked;
- `processed_logits`: those processed logits themselves.

For each row: the sampled token's value and rank (1 + the number of tokens scoring higher, counting ties:
vLLM's rank) and the row's top n.  A batch where no row asks costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.generation.params import DecodeParams
from services.protocol.logprobs import TokenLogprob

MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def is_raw(mode: str) -> bool:
    return mode.startswith("raw")


def processed(rows: torch.Tensor, params: Sequence[DecodeParams]) -> torch.Tensor:
    """Adjusted logits [rows, vocab] as the sampler draws from them: temperature, min_p, top-k, top-p (-inf)."""
    out = rows.float().clone()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = out[i].div_(p.temperature)
        if p.min_p > 0:
            probs = torch.softmax(row, dim=-1)
            row.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))
        if p.uses_top_k and p.top_k < row.shape[0]:
            kth = row.topk(p.top_k).values[-1]
            row.masked_fill_(row < kth, float("-inf"))
        if p.top_p < 1.0:
            values, order = row.sort(descending=False)
            mass = values.softmax(dim=-1).cumsum(dim=-1)
            drop = mass <= 1 - p.top_p
            drop[-1] = False   # at least one
            row[order[drop]] = float("-inf")
    return out


def scores(rows: torch.Tensor, params: Sequence[DecodeParams], mode: str) -> torch.Tensor:
    """What the records report for `rows` (raw logits for the raw modes, else the adjusted ones)."""
    values = rows.float() if is_raw(mode) else processed(rows, params)
    return torch.log_softmax(values, dim=-1) if mode.endswith("logprobs") else values


def gather(values: torch.Tensor, tokens: Sequence[int], counts: Sequence[int]) -> list[TokenLogprob]:
    """One record per row of `values` [rows, vocab] (scores()): token `tokens[i]`, top `counts[i]`."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=values.device).unsqueeze(1)
    sampled = values.gather(1, ids)
    ranks = (values >= sampled).sum(dim=1).tolist()
    k = min(max(counts), values.shape[1])
    top_values, top_ids = values.topk(k, dim=1) if k else (values[:, :0], ids[:, :0])
    out = []
    for i, (token, count) in enumerate(zip(tokens, counts, strict=True)):
        out.append(TokenLogprob(int(token), float(sampled[i, 0]), int(ranks[i]),
                                tuple(top_ids[i, :count].tolist()), tuple(top_values[i, :count].tolist())))
    return out
