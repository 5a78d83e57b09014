"""Image and video placeholder runs in token ids: finding them and expanding them.

A Qwen-VL prompt marks each image as ``<|vision_start|>`` + a run of ``<|image_pad|>`` +
``<|vision_end|>`` and each video the same way with ``<|video_pad|>``; a LLaVA prompt marks an
image as a bare run of ``<image>`` (no markers: `VisionTokens.start_id`/`end_id` None).  The chat
template emits runs of length 1; callers of the content_parts path may send them expanded already.
`fit_runs` replaces each length-1 run by its item's `Expansion` (one pad per embedding; for a Qwen3-VL
video, per frame group a timestamp, a start marker, the pads and an end marker, as its HF processor
writes it), keeps runs that are already a plain pad expansion of the right length and rejects anything
else, so both paths produce exactly what the HF processor produces.  The placeholder of an item is
what its run became (for images and Qwen2-VL videos the pads only, as in vLLM).  Without markers two
images must not touch (``<image><image>`` is one run).
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
    video_pad_id: int | None = None

    def modality_of(self, token: int) -> str | None:
        if token == self.pad_id:
            return "image"
        return "video" if token == self.video_pad_id and token is not None else None


@dataclass(frozen=True)
class Run:
    offset: int
    length: int
    modality: str = "image"


@dataclass(frozen=True)
class Expansion:
    """What one item's length-1 placeholder becomes."""

    modality: str
    tokens: tuple[int, ...]

    @classmethod
    def pads(cls, modality: str, pad_id: int, count: int) -> Expansion:
        return cls(modality, (pad_id,) * count)


def find_runs(token_ids: Sequence[int], tokens: VisionTokens) -> list[Run]:
    """Every pad run (images and videos), in order; a pad outside start...end markers is a 400."""
    runs: list[Run] = []
    i, n = 0, len(token_ids)
    while i < n:
        modality = tokens.modality_of(token_ids[i])
        if modality is None:
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == token_ids[i]:
            j += 1
        if not _enclosed(token_ids, i, j, tokens):
            raise InvalidRequest(
                f"{modality} placeholder at position {i} is not enclosed in vision start/end tokens",
                code="invalid_placeholders",
            )
        runs.append(Run(i, j - i, modality))
        i = j
    return runs


def _enclosed(token_ids: Sequence[int], i: int, j: int, tokens: VisionTokens) -> bool:
    """Whether run [i, j) has the family's markers around it (always, for a family without markers)."""
    starts = tokens.start_id is None or (i > 0 and token_ids[i - 1] == tokens.start_id)
    ends = tokens.end_id is None or (j < len(token_ids) and token_ids[j] == tokens.end_id)
    return starts and ends


def _match(runs: list[Run], media: Sequence[Expansion]) -> list[Expansion]:
    """The expansion of each run: the k-th run of a modality takes its k-th item."""
    by_modality: dict[str, list[Expansion]] = {}
    for expansion in media:
        by_modality.setdefault(expansion.modality, []).append(expansion)
    for modality in sorted({r.modality for r in runs} | set(by_modality)):
        found = sum(1 for r in runs if r.modality == modality)
        given = len(by_modality.get(modality, []))
        if found != given:
            raise InvalidRequest(f"the prompt has {found} {modality} placeholders but {given} {modality}s were given",
                                 code="placeholder_mismatch")
    taken = {modality: iter(items) for modality, items in by_modality.items()}
    return [next(taken[run.modality]) for run in runs]


def fit_runs(token_ids: Sequence[int], tokens: VisionTokens,
             media: Sequence[Expansion]) -> tuple[list[int], list[Run]]:
    """Token ids with each run expanded to its item's tokens, and each item's final range, in prompt order."""
    runs = find_runs(token_ids, tokens)
    out: list[int] = []
    placed: list[Run] = []
    cursor = 0
    seen: dict[str, int] = {}
    for run, expansion in zip(runs, _match(runs, media), strict=True):
        index = seen[run.modality] = seen.get(run.modality, -1) + 1
        expected = len(expansion.tokens)
        if run.length != 1 and not (run.length == expected and set(expansion.tokens) == {token_ids[run.offset]}):
            raise InvalidRequest(
                f"{run.modality} {index}: placeholder run has {run.length} tokens; expected 1 or {expected}",
                code="placeholder_mismatch",
            )
        out.extend(token_ids[cursor:run.offset])
        placed.append(Run(len(out), expected, run.modality))
        out.extend(expansion.tokens)
        cursor = run.offset + run.length
    out.extend(token_ids[cursor:])
    return out, placed
