"""A video's embeddings by frame group: each group encoded once, whichever videos it appears in.

A Qwen-VL video item is `video_grid_thw` = [t, h, w] and t frame groups (temporal patches of two
frames) of h*w patch rows each, in order (`pixel_values_videos` rows [i*h*w, (i+1)*h*w)).  In the
Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers nothing crosses a frame group: the patch embedding, the
norms, MLPs and mergers work per row or per 2x2 block, attention runs per group (`cu_seqlens`
repeats h*w per temporal patch; Qwen2.5-VL's windows are cut inside each group), and the position
embeddings and rotary angles depend on (h, w) only.  So group i's embeddings are the same whether it
is encoded alone or inside any video: bit for bit, with the kernels encode runs
(tests/services/encode/test_frame_groups.py encodes whole videos in one forward and by groups,
in any split, and compares the bytes; `VisionModel.frame_groups_independent` says which towers
were shown this).

So encode stores a video per group: a group's EC key is the content hash of what the tower reads
for it (its pixel rows' bytes, dtype and shape, and its grid), under the model's id (`ec_key`), so
the same frames give the same key whatever video, request or tenant they came in (as an image's
content-hashed key: the pixels already fix the processor settings).  A request whose video repeats or
overlaps stored groups (the same clip again, a longer clip of the same recording, a sliding window
over a stream) encodes only the groups that are new, and the video's handle is a composite of its
groups' handles (services.connectors.ec), which prefill reads as one entry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blake3 import blake3

from services.connectors.ec import ec_key

if TYPE_CHECKING:
    import torch

_DOMAIN = b"epd-frame-group-v1"
PIXELS, GRID = "pixel_values_videos", "video_grid_thw"


@dataclass(frozen=True)
class FrameGroup:
    index: int
    key: str                          # the group's EC key (model id + content hash)
    tensors: dict[str, torch.Tensor]  # what the tower encodes: the group's rows and grid [1, h, w]


def is_video(tensors: dict[str, Any]) -> bool:
    return PIXELS in tensors and GRID in tensors


def split(model_id: str, tensors: dict[str, torch.Tensor], weight_version: str = "") -> list[FrameGroup]:
    """The video's frame groups, in order, each with its content key (views of the pixels: no copy)."""
    import torch

    t, h, w = (int(v) for v in tensors[GRID].reshape(3).tolist())
    pixels = tensors[PIXELS]
    rows = h * w
    if t <= 0 or rows <= 0 or pixels.dim() != 2 or pixels.shape[0] != t * rows:
        from services.models.loading import InvalidMultiModalInput

        raise InvalidMultiModalInput(f"pixel_values_videos shape {tuple(pixels.shape)} does not match "
                                     f"video_grid_thw {[t, h, w]}")
    grid = torch.tensor([1, h, w], dtype=torch.long)
    groups = []
    for i in range(t):
        part = pixels[i * rows:(i + 1) * rows]
        key = ec_key(model_id, group_hash(part, h, w), weight_version)
        groups.append(FrameGroup(i, key, {PIXELS: part, GRID: grid}))
    return groups


def group_hash(rows: torch.Tensor, h: int, w: int) -> str:
    """The content hash of one group: its pixel rows (dtype, shape, bytes) and grid."""
    digest = blake3(_DOMAIN)
    digest.update(f"|{str(rows.dtype)}|{list(rows.shape)}|{[1, h, w]}|".encode())
    digest.update(rows.contiguous().numpy().data)
    return "fg-" + digest.hexdigest()


class VideoIndex:
    """A video's EC key (model, weight version, mm_hash) -> its group keys, for the videos this encoder stored
    (bounded, least recently used out first): a video asked for again by hash alone (no pixels) is answered from
    its stored groups."""

    def __init__(self, max_videos: int = 4096) -> None:
        self.max_videos = max_videos
        self._keys: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    def get(self, mm_hash: str) -> tuple[str, ...] | None:
        keys = self._keys.get(mm_hash)
        if keys is not None:
            self._keys.move_to_end(mm_hash)
        return keys

    def put(self, mm_hash: str, keys: tuple[str, ...]) -> None:
        self._keys[mm_hash] = keys
        self._keys.move_to_end(mm_hash)
        while len(self._keys) > self.max_videos:
            self._keys.popitem(last=False)
