"""Logprobs of generated tokens: one internal record per token, and the three shapes they are answered in.

Decode's sampler (and prefill's, for the first token) computes, for a request that asks
(`sampling_params.logprobs` = n, 0..20), a `TokenLogprob` per output token: the sampled id,
its logprob and rank, and the n most likely ids with their logprobs, sorted, from the raw
distribution of the model (log_softmax of the logits before penalties and temperature: vLLM's
default `logprobs_mode` "raw_logprobs").  Decode adds each token's text (`tokenizer.decode([id])`,
as vLLM's per-id decode for byte-level BPE).  The record travels as JSON (kv_transfer_params
for the first token, the gRPC chunk for the rest) and is answered as:

- `generate_logprobs`: vLLM's `GenerateLogProbs` (/inference/v1/generate, integer ids):
  `{"content": [{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", "logprob", "rank"}]}]}`,
  `top_logprobs` in vLLM's engine order (the sampled token first, then the others by rank),
  max(n, 1) entries;
- `text_logprobs`: the same in OpenAI's chat shape (token strings and bytes), for generate's
  `output_mode: "text"`;
- `chat_logprobs`: OpenAI's chat shape, `top_logprobs` the n most likely, sorted;
- `completion_logprobs`: OpenAI's legacy shape (`tokens`, `token_logprobs`, `top_logprobs`
  dicts of the sampled token plus the n most likely, `text_offset`).

Logprobs are floored at -9999.0 (NaN too), as vLLM's answers are.  No torch here: the
coordinator builds answers from these records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: more is a 400
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One output token: the sampled id with its logprob and rank (1 = most likely), and the top n."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    token: str | None = None                 # text of token_id (decode fills it in)
    top_tokens: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.token_id, "lp": self.logprob, "rank": self.rank,
                                "top": list(self.top_ids), "top_lp": list(self.top_logprobs)}
        if self.token is not None:
            body["tok"] = self.token
        if self.top_tokens is not None:
            body["top_tok"] = list(self.top_tokens)
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TokenLogprob:
        top_tokens = body.get("top_tok")
        return cls(int(body["id"]), float(body["lp"]), int(body["rank"]), tuple(int(t) for t in body["top"]),
                   tuple(float(v) for v in body["top_lp"]), body.get("tok"),
                   None if top_tokens is None else tuple(top_tokens))

    def with_text(self, decode: Any) -> TokenLogprob:
        """A copy with the token texts, `decode(id) -> str`."""
        return TokenLogprob(self.token_id, self.logprob, self.rank, self.top_ids, self.top_logprobs,
                            decode(self.token_id), tuple(decode(t) for t in self.top_ids))


def as_token_ids(entries: Sequence[TokenLogprob]) -> list[TokenLogprob]:
    """The records without their texts: answered as 'token_id:<id>' (vLLM's return_tokens_as_token_ids)."""
    return [TokenLogprob(e.token_id, e.logprob, e.rank, e.top_ids, e.top_logprobs) for e in entries]


def dumps_list(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [e.to_json() for e in entries]


def loads_list(bodies: Any) -> list[TokenLogprob]:
    return [TokenLogprob.from_json(b) for b in bodies or []]


def floor(value: float) -> float:
    return FLOOR if math.isnan(value) else max(value, FLOOR)


def _text(entry: TokenLogprob) -> str:
    return entry.token if entry.token is not None else f"token_id:{entry.token_id}"


def _top_text(entry: TokenLogprob, i: int) -> str:
    return entry.top_tokens[i] if entry.top_tokens is not None else f"token_id:{entry.top_ids[i]}"


def _engine_order(e: TokenLogprob) -> list[tuple[int, float, int, str]]:
    """(id, logprob, rank, text) of the sampled candidate first, then the rest by rank: max(n, 1) of them."""
    top = [(e.token_id, e.logprob, e.rank, _text(e))]
    top += [(t, v, r, _top_text(e, r - 1))
            for r, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True), 1) if t != e.token_id]
    return top[:max(len(e.top_ids), 1)]


def generate_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """vLLM's GenerateLogProbs: per token the sampled candidate first, then the rest by rank."""
    return {"content": [{"token_id": e.token_id, "logprob": floor(e.logprob), "rank": e.rank,
                         "top_logprobs": [{"token_id": t, "logprob": floor(v), "rank": r}
                                          for t, v, r, _ in _engine_order(e)]} for e in entries]}


def text_logprobs(entries: Sequence[TokenLogprob], as_ids: bool = False) -> dict[str, Any]:
    """Generate's output_mode 'text' (vLLM's _create_text_logprobs): OpenAI's chat shape (token strings, bytes),
    `top_logprobs` in generate's engine order (the sampled candidate first, max(n, 1) entries).  `as_ids`
    (--return-tokens-as-token-ids): every token 'token_id:<id>' with no bytes, as vLLM answers it."""
    if as_ids:
        return {"content": [{"token": f"token_id:{e.token_id}", "logprob": floor(e.logprob), "bytes": None,
                             "top_logprobs": [{"token": f"token_id:{t}", "logprob": floor(v), "bytes": None}
                                              for t, v, _, _ in _engine_order(e)]} for e in entries]}
    return {"content": [{**_candidate(_text(e), e.logprob),
                         "top_logprobs": [_candidate(s, v) for _, v, _, s in _engine_order(e)]} for e in entries]}


def from_generate(body: Any) -> list[TokenLogprob] | None:
    """Records from a GenerateLogProbs answer (derender's input); its candidates by rank as the top n.

    vLLM's engine order lists the sampled token first: when it is not among the n most likely, the
    answer holds it and the n - 1 most likely, and so does the record."""
    if not isinstance(body, dict) or not isinstance(body.get("content"), list):
        return None
    out = []
    for entry in body["content"]:
        top = sorted(entry.get("top_logprobs") or [], key=lambda t: -float(t["logprob"]))
        out.append(TokenLogprob(int(entry["token_id"]), float(entry["logprob"]), int(entry.get("rank") or 0),
                                tuple(int(t["token_id"]) for t in top), tuple(float(t["logprob"]) for t in top)))
    return out


def _candidate(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": floor(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob], as_ids: bool = False) -> dict[str, Any]:
    """OpenAI chat: {"content": [{token, logprob, bytes, top_logprobs: the n most likely, sorted}]}.  `as_ids`
    (return_tokens_as_token_ids): tokens 'token_id:<id>'; as vLLM answers them, a sampled token's bytes stay its
    text's, a top entry's are its placeholder's."""
    if as_ids:
        return {"content": [{"token": f"token_id:{e.token_id}", "logprob": floor(e.logprob),
                             "bytes": list(_text(e).encode("utf-8", errors="replace")),
                             "top_logprobs": [_candidate(f"token_id:{t}", v)
                                              for t, v in zip(e.top_ids, e.top_logprobs, strict=True)]}
                            for e in entries]}
    return {"content": [{**_candidate(_text(e), e.logprob),
                         "top_logprobs": [_candidate(_top_text(e, i), v) for i, v in enumerate(e.top_logprobs)]}
                        for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """OpenAI completions: tokens, token_logprobs, top_logprobs ({text: logprob}: the sampled token and the
    n most likely), text_offset (where each token's text starts in the output)."""
    tokens, offsets, tops = [], [], []
    offset = text_offset
    for e in entries:
        text = _text(e)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top = {text: floor(e.logprob)}
        for i, value in enumerate(e.top_logprobs):
            top.setdefault(_top_text(e, i), floor(value))
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": [floor(e.logprob) for e in entries], "tokens": tokens,
            "top_logprobs": tops}
