"""Image placeholder runs in token ids: finding them and sizing them.

A Qwen-VL prompt marks each image as ``<|vision_start|>`` + a run of
``<|image_pad|>`` + ``<|vision_end|>``; a LLaVA prompt as a bare run of
``<image>`` (no markers: `VisionTokens.start_id`/`end_id` None).  The model
needs one pad per image embedding (Qwen-VL: grid_t*grid_h*grid_w / merge**2;
LLaVA: a fixed count).  The chat template emits runs of length 1; callers of
the content_parts path may send them expanded already.  `fit_runs` expands
length-1 runs, keeps runs of the right length and rejects anything else, so
both paths produce exactly what the HF processor produces.  The placeholder of
an item is its pad run only (not the start/end markers), as in vLLM.  Without
markers two images must not touch (``<image><image>`` is one run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.protocol.errors import InvalidRequest


@dataclass(frozen=True)
class VisionTokens:
    start_id: int | None
    pad_id: int
    end_id: int | None


@dataclass(frozen=True)
class Run:
    offset: int
    length: int


def find_runs(token_ids: Sequence[int], tokens: VisionTokens) -> list[Run]:
    """Every pad run, in order; a pad outside start...end markers is a 400."""
    runs: list[Run] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] != tokens.pad_id:
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == tokens.pad_id:
            j += 1
        if not _enclosed(token_ids, i, j, tokens):
            raise InvalidRequest(
                f"image placeholder at position {i} is not enclosed in vision start/end tokens",
                code="invalid_placeholders",
            )
        runs.append(Run(i, j - i))
        i = j
    return runs


def _enclosed(token_ids: Sequence[int], i: int, j: int, tokens: VisionTokens) -> bool:
    """Whether run [i, j) has the family's markers around it (always, for a family without markers)."""
    starts = tokens.start_id is None or (i > 0 and token_ids[i - 1] == tokens.start_id)
    ends = tokens.end_id is None or (j < len(token_ids) and token_ids[j] == tokens.end_id)
    return starts and ends


def fit_runs(token_ids: Sequence[int], tokens: VisionTokens,
             counts: Sequence[int]) -> tuple[list[int], list[Run]]:
    """Token ids with run k sized to counts[k], and the final runs (offset, length)."""
    runs = find_runs(token_ids, tokens)
    if len(runs) != len(counts):
        raise InvalidRequest(
            f"the prompt has {len(runs)} image placeholders but {len(counts)} images were given",
            code="placeholder_mismatch",
        )
    out: list[int] = []
    placed: list[Run] = []
    cursor = 0
    for index, (run, count) in enumerate(zip(runs, counts, strict=True)):
        if run.length not in (1, count):
            raise InvalidRequest(
                f"image {index}: placeholder run has {run.length} tokens; expected 1 or {count}",
                code="placeholder_mismatch",
            )
        out.extend(token_ids[cursor:run.offset])
        placed.append(Run(len(out), count))
        out.extend([tokens.pad_id] * count)
        cursor = run.offset + run.length
    out.extend(token_ids[cursor:])
    return out, placed
