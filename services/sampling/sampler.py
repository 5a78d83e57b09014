"""Token sampling for a batch of requests, each with its own `DecodeParams`.

Order per row (as vLLM): penalties, min_tokens suppression, then greedy
argmax, or temperature -> min_p / top_k -> top_p -> one draw.

A draw is inverse-CDF with one uniform number.  For a seeded request the
uniform for output index i is a pure function of (seed, i) (splitmix64), so a
seeded request gets the same tokens whatever else shares its batch, on any
device; an unseeded one draws from the sampler's own RNG.  The first output
token (sampled by prefill) is index 0: prefill calls `sample_first_logprobs` with the
same rules, and decode continues at index 1.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Sequence

import torch

from services.generation.params import DecodeParams
from services.protocol.logprobs import TokenLogprob
from services.sampling.penalties import PenaltyState
from services.sampling.token_logprobs import gather, is_raw, scores

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, index)."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64))
    return (z >> 11) * (1.0 / (1 << 53))


class RowSampling:
    """Per-request sampling state: params, next output index, penalties, min_tokens suppression."""

    def __init__(self, params: DecodeParams, eos_token_ids: Sequence[int] = (),
                 prompt_token_ids: Sequence[int] | None = None, index: int = 0) -> None:
        self.params = params
        self.index = index
        self.penalties = PenaltyState(params, prompt_token_ids) if params.has_penalties else None
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        # While fewer than min_tokens are out, neither EOS nor a stop token may be drawn.
        self.suppressed = sorted(set(eos) | set(params.stop_token_ids)) if params.min_tokens else []
        self.logprobs: TokenLogprob | None = None  # the last sampled token's, when params.logprobs asks

    def take_logprobs(self) -> TokenLogprob | None:
        """The logprobs of the token just sampled (once), or None."""
        record, self.logprobs = self.logprobs, None
        return record

    @property
    def needs_adjust(self) -> bool:
        return self.penalties is not None or (bool(self.suppressed) and self.index < self.params.min_tokens)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs every logit (logprobs, penalties, suppression): the LM head screen's."""
        return self.params.is_greedy and self.params.logprobs is None and not self.needs_adjust

    @property
    def plain_sampled(self) -> bool:
        """A temperature draw from every logit and nothing else (no top-k, top-p, min-p, logprobs, penalties or
        suppression): the screen's draw (services/sampling/screened.py)."""
        p = self.params
        return (not p.is_greedy and _layout(p) == "plain" and p.min_p == 0 and p.logprobs is None
                and not self.needs_adjust)

    def adjust(self, row: torch.Tensor) -> None:
        """Penalties and min_tokens suppression on one row of logits [vocab], in place."""
        if self.penalties is not None:
            self.penalties.apply(row)
        if self.suppressed and self.index < self.params.min_tokens:
            ids = [t for t in self.suppressed if t < row.shape[0]]
            row[ids] = float("-inf")

    def uniform(self, rng: random.Random) -> float:
        seed = self.params.seed
        return seeded_uniform(seed, self.index) if seed is not None else rng.random()

    def record(self, token_id: int) -> None:
        """Account for the token just emitted at `index`."""
        if self.penalties is not None:
            self.penalties.record(token_id)
        self.index += 1


class Sampler:
    """Samples one token per row of a [B, vocab] logits batch; logprobs in `logprobs_mode` (token_logprobs.py)."""

    def __init__(self, seed: int | None = None, logprobs_mode: str = "raw_logprobs") -> None:
        self.rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self.logprobs_mode = logprobs_mode

    def sample(self, logits: torch.Tensor, rows: Sequence[RowSampling], inplace: bool = False) -> list[int]:
        """Token ids for every row; does not call `record` (the caller does, once it keeps the token).

        `inplace=True` lets penalties and suppression write into `logits` (the engine's own tensor).
        Rows whose params ask for logprobs get them in `row.logprobs`: from the raw logits (raw modes) or the
        adjusted ones the token was drawn from (processed modes).
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} requests")
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw = is_raw(self.logprobs_mode)
        before = logits[wanted] if wanted and raw else None  # a copy (index list), taken before any adjustment
        tokens, adjusted = self._tokens(logits, rows, inplace)
        if wanted:
            values = scores(before if before is not None else adjusted[wanted], [rows[i].params for i in wanted],
                            self.logprobs_mode)
            records = gather(values, [tokens[i] for i in wanted], [rows[i].params.logprobs or 0 for i in wanted])
            for i, record in zip(wanted, records, strict=True):
                rows[i].logprobs = record
        return tokens

    def _tokens(self, logits: torch.Tensor, rows: Sequence[RowSampling],
                inplace: bool) -> tuple[list[int], torch.Tensor]:
        """The tokens, and the logits after penalties and suppression (what temperature and the masks act on)."""
        logits = _adjusted(logits, rows, inplace)
        # Without logprobs the adjusted logits are not read again: an engine's own tensor (inplace) may be drawn on.
        scratch = inplace and not any(row.params.logprobs is not None for row in rows)
        return self._draw(logits, rows, scratch), logits

    def _draw(self, logits: torch.Tensor, rows: Sequence[RowSampling], scratch: bool = False) -> list[int]:
        """`scratch`: `logits` may be overwritten (a group of the whole batch is then drawn on it, not on a copy)."""
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if len(greedy) == len(rows):
            return greedy_argmax(logits).tolist()
        tokens = [0] * len(rows)
        if greedy:
            _place(tokens, greedy, greedy_argmax(logits[greedy]).tolist())
        # Rows are drawn in groups by candidate layout, which depends only on their own params:
        # a row's draw must not change with what else shares the batch.
        groups: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            if not row.params.is_greedy:
                groups.setdefault(_layout(row.params), []).append(i)
        for layout, members in groups.items():
            group = logits if scratch and len(members) == len(rows) else logits[members]   # an index list copies
            _place(tokens, members, self._draw_group(group, [rows[i] for i in members], layout))
        return tokens

    def _draw_group(self, logits: torch.Tensor, rows: Sequence[RowSampling], layout: str) -> list[int]:
        """Tokens of rows sharing one candidate layout; `logits` is the group's own and is overwritten."""
        params = [row.params for row in rows]
        uniforms = torch.tensor([row.uniform(self.rng) for row in rows], device=logits.device).unsqueeze(1)
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            logits.div_(torch.tensor(temps, device=logits.device).unsqueeze(1))
        if layout == "plain" and not any(p.min_p > 0 for p in params):
            return _draw_plain(logits, uniforms).squeeze(1).tolist()
        values, ids = _candidates(logits, params, layout)
        probs = _filtered_probs(values, params, is_sorted=ids is not None)
        positions = _inverse_cdf(probs, uniforms.to(probs.dtype))
        tokens = ids.gather(1, positions) if ids is not None else positions
        return tokens.squeeze(1).tolist()


def _adjusted(logits: torch.Tensor, rows: Sequence[RowSampling], inplace: bool) -> torch.Tensor:
    """float32 logits with penalties and min_tokens suppression applied (a copy unless `inplace`)."""
    adjusted = [i for i, row in enumerate(rows) if row.needs_adjust]
    if adjusted and not inplace and logits.dtype == torch.float32:
        logits = logits.clone()
    logits = logits.float()
    for i in adjusted:
        rows[i].adjust(logits[i])
    return logits


def _place(tokens: list[int], indices: Sequence[int], picked: Sequence[int]) -> None:
    for i, token in zip(indices, picked, strict=True):
        tokens[i] = token


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, first index among ties (as `max(dim).indices`), ~5x faster on CPU for a large vocab.

    max-with-indices over the last dim is not vectorised on CPU (0.3 ms per 152k-wide row, the
    largest per-row cost of a tiny model's decode step); `amax` is.  So: amax per chunk of
    columns, the first chunk holding the row's max, then max-with-indices inside that chunk only.
    That chunk holds the first occurrence of the max, so ties resolve exactly as before.  A NaN
    row (amax propagates it) takes the plain path, which returns the NaN's index as before.
    """
    width = _chunk_width(logits.shape[-1]) if logits.dim() == 2 and logits.is_contiguous() else None
    if width is None:
        return logits.max(dim=-1).indices
    rows, vocab = logits.shape
    chunks = logits.view(rows, vocab // width, width)
    top = chunks.amax(dim=-1).max(dim=-1)
    if torch.isnan(top.values).any():
        return logits.max(dim=-1).indices
    inside = chunks[torch.arange(rows, device=logits.device), top.indices].max(dim=-1).indices
    return top.indices * width + inside


@functools.lru_cache(maxsize=16)
def _chunk_width(vocab: int) -> int | None:
    """A divisor of `vocab` near 2048 (151936 -> 2374), or None when there is none in [256, 8192]."""
    divisors = [w for w in range(256, min(vocab, 8192) + 1) if vocab % w == 0]
    return min(divisors, key=lambda w: abs(w - 2048)) if divisors and vocab >= 4 * divisors[0] else None


def _layout(params: DecodeParams) -> str:
    """top_k: the top-k candidates, sorted; sorted: the whole vocab sorted (top-p without top-k);
    plain: the whole vocab in id order (no sort needed)."""
    if params.uses_top_k:
        return "top_k"
    return "sorted" if params.top_p < 1.0 else "plain"


def _candidates(logits: torch.Tensor, params: Sequence[DecodeParams], layout: str
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits to draw from and their ids (None: column = id).

    A full-vocab sort is the expensive part of sampling: with a top-k only the top max(k)
    candidates are sorted, and without top-k or top-p nothing is.
    """
    if layout == "top_k":
        k = min(max(p.top_k for p in params), logits.shape[1])
        return logits.topk(k, dim=1)
    if layout == "sorted":
        return logits.sort(dim=1, descending=True)
    return logits, None


def _filtered_probs(values: torch.Tensor, params: Sequence[DecodeParams], is_sorted: bool) -> torch.Tensor:
    """min_p and top-k masks on logits, softmax, then the top-p cut on the renormalised probabilities."""
    width = values.shape[1]
    if any(p.uses_top_k for p in params):
        k = torch.tensor([p.top_k if p.uses_top_k else width for p in params], device=values.device)
        columns = torch.arange(width, device=values.device).unsqueeze(0)
        values = values.masked_fill(columns >= k.unsqueeze(1), float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=values.device).unsqueeze(1)
        top = values[:, :1] if is_sorted else values.max(dim=1, keepdim=True).values
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        values = values.masked_fill(values < top + torch.log(min_p), float("-inf"))
    probs = torch.softmax(values, dim=1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=values.device).unsqueeze(1)
        before = probs.cumsum(dim=1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        probs = probs.masked_fill(before >= top_p, 0.0)
    return probs


def _draw_plain(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`_inverse_cdf(softmax(logits), uniforms)` in three passes over the logits, in place and unnormalised: the
    first column whose running sum of exp(logit - max) exceeds u * the row's sum.  A full vocabulary at a large
    batch (RL rollouts: 64 rows x 152k) drew in ~1/3 of a decode step through softmax, cumsum and their copies."""
    logits.sub_(logits.amax(dim=1, keepdim=True)).exp_().cumsum_(dim=1)   # now each row's running sum
    positions = torch.searchsorted(logits, uniforms.to(logits.dtype) * logits[:, -1:], right=True)
    positions.clamp_(max=logits.shape[1] - 1)
    # u * sum rounded up to the sum lands past the last column that carries mass: take the most likely one
    # (the column where the running sum rises most), as _inverse_cdf does.
    picked = logits.gather(1, positions)
    before = logits.gather(1, (positions - 1).clamp_(min=0)).masked_fill_(positions == 0, 0.0)
    for row in (picked <= before).squeeze(1).nonzero().flatten().tolist():
        positions[row, 0] = torch.diff(logits[row], prepend=logits.new_zeros(1)).argmax()
    return positions


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column index per row: the first whose cumulative mass exceeds u * total."""
    cdf = probs.cumsum(dim=1)
    targets = uniforms * cdf[:, -1:]
    positions = torch.searchsorted(cdf, targets, right=True).clamp_(max=probs.shape[1] - 1)
    # Rounding can land on a zero-probability tail column; fall back to the most likely one.
    fallback = probs.argmax(dim=1, keepdim=True)
    return torch.where(probs.gather(1, positions) > 0, positions, fallback)


def sample_first_logprobs(logits: torch.Tensor, params: DecodeParams, index: int = 0,
                          eos_token_ids: Sequence[int] = (), prompt_token_ids: Sequence[int] | None = None,
                          sampler: Sampler | None = None,
                          logprobs_mode: str = "raw_logprobs") -> tuple[int, TokenLogprob | None]:
    """One token sampled from logits [vocab] with decode's rules (prefill's first output token), and its
    logprobs when `params.logprobs` asks for them (else None)."""
    row = RowSampling(params, eos_token_ids, prompt_token_ids, index=index)
    token = (sampler or Sampler(logprobs_mode=logprobs_mode)).sample(logits.reshape(1, -1), [row])[0]
    return token, row.take_logprobs()
