"""Logprobs of sampled tokens, computed only for the rows of a batch that ask for them.

`raw_rows` are the logits as the model produced them (before penalties, min_tokens
suppression and temperature: vLLM's default `logprobs_mode` "raw_logprobs"), copied out of the
batch before the sampler adjusts it in place.  For each row: log_softmax over the vocabulary,
the sampled token's logprob and rank (1 + the number of tokens at least as likely, counting
itself: vLLM's rank), and the row's top n.  A batch where no row asks costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.protocol.logprobs import TokenLogprob


def gather(raw_rows: torch.Tensor, tokens: Sequence[int], counts: Sequence[int]) -> list[TokenLogprob]:
    """One record per row of `raw_rows` [rows, vocab]: token `tokens[i]`, top `counts[i]`."""
    logprobs = torch.log_softmax(raw_rows.float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device).unsqueeze(1)
    sampled = logprobs.gather(1, ids)
    ranks = (logprobs >= sampled).sum(dim=1).tolist()
    k = min(max(counts), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=1) if k else (logprobs[:, :0], ids[:, :0])
    out = []
    for i, (token, count) in enumerate(zip(tokens, counts, strict=True)):
        out.append(TokenLogprob(int(token), float(sampled[i, 0]), int(ranks[i]),
                                tuple(top_ids[i, :count].tolist()), tuple(top_values[i, :count].tolist())))
    return out
