"""Keys and handles of the EC (encoder cache) store: one entry per multimodal item, or per frame group, scoped by
model and weight version.

Encode puts an item's embeddings under `ec_key(model_id, mm_hash, weight_version)`; prefill
loads them by handle.  The same item under another model, or made by other weights (a weight
update: services/weights/role.py), is another entry.

A video is stored per frame group instead (services/encode/frame_groups.py): one entry per group,
keyed by the content hash of the group's pixels, and the video's handle is a *composite* one,
`{"frame_groups": [group handle, ...], "token_dims": {tensor name: token axis}}`, that lists its
groups in order; a reader concatenates the groups' tensors along their token axis
(`FrameGroupReader`).  Groups shared by several videos are stored once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from .base import EntryCorrupt, StoreStats, TensorStore

if TYPE_CHECKING:
    import torch

FRAME_GROUPS = "frame_groups"
TOKEN_DIMS = "token_dims"
MAX_GROUPS = 4096   # a composite handle names at most this many entries (a handle is client-visible JSON)


def ec_key(model_id: str, mm_hash: str, weight_version: str = "") -> str:
    if not model_id or not mm_hash:
        raise ValueError("ec_key needs a model id and an mm_hash")
    return f"{model_id}|{weight_version}|{mm_hash}" if weight_version else f"{model_id}|{mm_hash}"


def ec_key_version(key: str) -> str:
    """The weight version an EC key names ("" for a key made without one)."""
    parts = key.rsplit("|", 2)
    return parts[1] if len(parts) == 3 else ""


def composite_handle(handles: Sequence[dict[str, Any]], token_dims: Mapping[str, int]) -> dict[str, Any]:
    return {FRAME_GROUPS: list(handles), TOKEN_DIMS: dict(token_dims)}


def is_composite(handle: Any) -> bool:
    return isinstance(handle, dict) and FRAME_GROUPS in handle


def _parts(handle: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    parts, dims = handle.get(FRAME_GROUPS), handle.get(TOKEN_DIMS) or {}
    if not isinstance(parts, list) or not parts or len(parts) > MAX_GROUPS or \
            not all(isinstance(p, dict) and not is_composite(p) for p in parts):
        raise EntryCorrupt(f"a composite EC handle needs 1..{MAX_GROUPS} plain entry handles")
    if not isinstance(dims, dict) or not all(isinstance(v, int) and 0 <= v < 8 for v in dims.values()):
        raise EntryCorrupt("a composite EC handle's token_dims must map tensor names to small axes")
    return parts, dims


def concat_groups(entries: Sequence[Mapping[str, torch.Tensor]], dims: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """The groups' tensors joined along each tensor's token axis (0 unless `dims` says otherwise)."""
    import torch

    names = list(entries[0])
    if any(list(entry) != names for entry in entries):
        raise EntryCorrupt("the frame groups of a composite EC handle hold different tensors")
    try:
        return {name: torch.cat([entry[name] for entry in entries], dims.get(name, 0)) for name in names}
    except RuntimeError as exc:   # shapes that do not line up: a damaged or forged handle
        raise EntryCorrupt(f"the frame groups of a composite EC handle do not fit together: {exc}") from None


class FrameGroupReader(TensorStore):
    """An EC store as prefill reads it: plain handles as the store serves them, composite ones (a video's
    frame groups) as the concatenation of their groups.  Everything else is the wrapped store's."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store
        self.backend = store.backend
        self.local = store.local

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return self.store.put(key, tensors)

    def lookup(self, key: str) -> dict[str, Any] | None:
        return self.store.lookup(key)

    def get(self, handle: dict[str, Any]) -> dict[str, torch.Tensor]:
        if not is_composite(handle):
            return self.store.get(handle)
        parts, dims = _parts(handle)
        return concat_groups([self.store.get(part) for part in parts], dims)

    @contextmanager
    def view(self, handle: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
        if not is_composite(handle):
            with self.store.view(handle) as tensors:
                yield tensors
            return
        parts, dims = _parts(handle)
        with ExitStack() as views:   # each group a zero-copy view until the concatenation (the one copy)
            yield concat_groups([views.enter_context(self.store.view(part)) for part in parts], dims)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def release(self, handle: dict[str, Any]) -> None:
        for part in _parts(handle)[0] if is_composite(handle) else [handle]:
            self.store.release(part)

    def stats(self) -> StoreStats:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)
