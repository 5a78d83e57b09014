"""The last resort when no encode instance can take an item: prefill encodes it itself.

Normally prefill holds no vision tower and never sees pixels.  When every
encode instance is down or full, the coordinator sends those items' kwargs_data
to prefill instead of failing the request; this module loads the family's
vision tower on first use (once, under a lock; it is then kept) and computes
the same EC entry encode would have stored (embedding plus family extras), so
the output is the same tokens.  The entry is used directly, not stored: only
encode instances own EC stores.

Loading costs the tower's weights in memory and some seconds for large models;
`--prefill-inline-encode false` turns the fallback off (the request then gets
503 "no healthy encode instance").
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from services.hostcpu import compute_threads
from services.protocol.errors import InvalidRequest
from services.protocol.items import Item
from services.protocol.tensors import to_torch

if TYPE_CHECKING:
    import torch

    from services.models.base import VisionModel

log = logging.getLogger(__name__)
INLINE_ITEMS = Counter("epd_prefill_inline_encoded_items", "Items prefill encoded itself (no encoder could)")


class InlineEncoder:
    def __init__(self, adapter: Any, path: str | Path, device: str, dtype: str) -> None:
        self.adapter, self.path, self.device, self.dtype = adapter, path, device, dtype
        self._vision: VisionModel | None = None
        self._lock = threading.Lock()

    def entry(self, kwargs: Item) -> dict[str, torch.Tensor]:
        """{"embedding": ..., extras} for one item's kwargs_data (blocking: call from a thread)."""
        tensors = {name: to_torch(elem.data) for name, elem in kwargs.items()  # type: ignore[arg-type]
                   if elem.data is not None}
        with self._lock:  # one forward at a time; the first caller also loads the tower
            vision = self._load()
            try:
                # on the role's compute threads, not the one torch thread of a helper (compute_threads.py)
                [entry] = compute_threads.run_in_fresh_thread(lambda: _encode(vision, tensors),
                                                              name="prefill-inline-encode")
            except (ValueError, KeyError, RuntimeError) as exc:
                raise InvalidRequest(f"item cannot be encoded: {type(exc).__name__}: {exc}",
                                     code="invalid_kwargs_data") from None
        INLINE_ITEMS.inc()
        return entry

    def _load(self) -> VisionModel:
        if self._vision is None:
            log.warning("no encode instance could take an item: loading the vision tower into prefill")
            self._vision = self.adapter.load_vision(self.path, self.device, self.dtype)
        return self._vision


def _encode(vision: VisionModel, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return vision.encode_entries([tensors])
