"""M-RoPE positions of a Qwen-VL prompt from its items' grids, without the model: what prefill and decode use.

An item is one or more *segments*, runs of placeholder tokens with a [t, h, w] patch grid: an image
is one segment (t = 1), a Qwen2-VL / Qwen2.5-VL video one segment of t frame groups, a Qwen3-VL video
one segment per frame group (t = 1), with the timestamp text and markers between them counted as text.
Text counts on from the last position on all three axes; a segment's tokens take
(start + t index * t_factor, start + row, start + column) over its merged grid, t_factor being
Qwen2.5-VL's `second_per_grid_ts * tokens_per_second` for videos (1 otherwise), and the text after
it starts one past the largest position the segment used.

That last rule is vLLM's (0.32 `get_mrope_input_positions`, and transformers 4.x's `get_rope_index`,
the positions these models were trained with).  transformers 5.x starts the text after a segment at
start + max(h, w) / merge instead: the same for images and for videos whose temporal positions stay
below their spatial ones, earlier (inside the video's time span) for longer videos.  epd follows
vLLM, so a render answer means the same prompt in both (tests/services/models/test_mrope.py shows
where transformers 5.x parts from it).  The t index times t_factor is computed in float64 and
truncated, as vLLM computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.models.loading import InvalidMultiModalInput


@dataclass(frozen=True)
class Segment:
    offset: int                      # first placeholder token
    tokens: int                      # placeholder tokens (= embeddings) in the run
    grid: tuple[int, int, int]       # [t, h, w] in patches (before the spatial merge)
    t_factor: float = 1.0            # temporal position step per frame group


def mrope_positions(length: int, segments: Sequence[Segment], merge: int) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, length] (int64) and rope_delta of a prompt whose segments sit in order, apart."""
    positions = np.empty((3, length), dtype=np.int64)
    at = start = 0
    for seg in segments:
        positions[:, at:seg.offset] = np.arange(start, start + seg.offset - at)
        start += seg.offset - at
        t, h, w = seg.grid
        rows, cols = h // merge, w // merge
        if t * rows * cols != seg.tokens:
            raise InvalidMultiModalInput(f"item at {seg.offset}: grid {[t, h, w]} does not give {seg.tokens} tokens")
        frames = np.arange(t)
        if seg.t_factor != 1.0:
            frames = (frames * seg.t_factor).astype(np.int64)
        span = slice(seg.offset, seg.offset + seg.tokens)
        positions[0, span] = np.repeat(start + frames, rows * cols)
        positions[1, span] = np.tile(np.repeat(start + np.arange(rows), cols), t)
        positions[2, span] = np.tile(start + np.arange(cols), t * rows)
        start = int(positions[:, span].max()) + 1
        at = seg.offset + seg.tokens
    positions[:, at:] = np.arange(start, start + length - at)
    return positions, int(positions.max()) + 1 - length if length else 0


def pad_runs(token_ids: Sequence[int], offset: int, length: int, pad_id: int) -> list[tuple[int, int]]:
    """(start, count) of each run of `pad_id` inside [offset, offset + length), in order."""
    runs: list[tuple[int, int]] = []
    i, end = offset, offset + length
    while i < end:
        if token_ids[i] != pad_id:
            i += 1
            continue
        j = i
        while j < end and token_ids[j] == pad_id:
            j += 1
        runs.append((i, j - i))
        i = j
    return runs
