"""One packed prefill forward: chunks of several prompts as one sequence through the decoder stack.

Each chunk is rows [start, end) of one prompt whose KV blocks are allocated in the pool
(rows before `start` already written there by earlier chunks or shared from the prefix
cache).  The chunks' embeddings and positions (each prompt's own, from its own rope index:
M-RoPE stays per prompt) are concatenated along the sequence; attention keeps prompts apart
(attention.py) and writes every new row's KV into the pool.  Family extras for the rows
(Qwen3-VL deepstack) come from `LanguageModel.packed_kwargs`.  Returns the final hidden state
of each chunk's last row: the LM head is applied by the caller to the chunks that finish a
prompt only, and the last layer's o_proj and MLP run on those rows only (last_rows.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.models.base import LanguageModel, PrefillInputs
from services.prefill.attention import PLAN_KWARG, Segment, make_plan
from services.prefill.kv_pool import KVPool
from services.prefill.last_rows import RowSubset, only_rows

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Chunk:
    inputs: PrefillInputs
    start: int
    end: int
    blocks: tuple[int, ...]  # the prompt's blocks (at least those holding rows [0, end))

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def forward_rows(lm: LanguageModel, pool: KVPool, chunks: list[Chunk], last_rows: list[RowSubset] | None = None,
                 whole: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """[len(chunks), hidden]: the last row's final hidden state of each chunk (KV lands in the pool), and for
    each chunk index in `whole` the final hidden state of every one of its rows [num_tokens, hidden] (prompt
    logprobs: services/prefill/prompt_logprobs.py).  With `last_rows` (services/prefill/last_rows.py) the last
    layer's o_proj and MLP run on those rows only."""
    import torch

    embeds = torch.cat([c.inputs.inputs_embeds[:, c.start:c.end] for c in chunks], dim=1)
    positions = torch.cat([c.inputs.position_ids[..., c.start:c.end] for c in chunks], dim=-1)
    segments, row = [], 0
    for chunk in chunks:
        slots = pool.slots(list(chunk.blocks), 0, chunk.end)
        segments.append(Segment(q0=row, n=chunk.num_tokens, past=chunk.start, slots=slots))
        row += chunk.num_tokens
    plan = make_plan(pool, segments)
    extra = lm.packed_kwargs([(c.inputs, c.start, c.end) for c in chunks])
    # A 4-D mask is taken as is (no T x T mask is built); packed attention ignores it.
    placeholder = torch.zeros(1, 1, 1, 1, dtype=embeds.dtype, device=embeds.device)
    last = torch.tensor([s.q0 + s.n - 1 for s in segments], device=embeds.device)
    wanted = {i: torch.arange(s.q0, s.q0 + s.n, device=embeds.device) for i, s in enumerate(segments) if i in whole}
    read = torch.cat([last, *wanted.values()]).unique() if wanted else last
    with only_rows(last_rows, read) if last_rows else nullcontext():
        out = lm.model(inputs_embeds=embeds, position_ids=positions, attention_mask=placeholder, use_cache=False,
                       **{PLAN_KWARG: plan}, **extra)
    hidden = out.last_hidden_state[0]
    return hidden.index_select(0, last), {i: hidden.index_select(0, rows) for i, rows in wanted.items()}
