"""The consumer side of the shm backend: cached attachments and verified reads by handle.

A read checks the entry's slot header before and after touching the payload
(see shm_layout): a generation or state change means the entry was freed,
evicted or overwritten meanwhile (EntryMissing); a header that is not ours or
does not describe the handle's entry is EntryCorrupt.  Attachments are cached
per segment and re-validated by inode on each read, so a segment that was
unlinked (producer closed, exited or was swept) reads as EntryMissing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from services.connectors.base import EntryCorrupt, EntryMissing
from services.connectors.codec import TensorSpec, byte_view, crc_of, key_hash, specs_from, tensor_at
from services.connectors.shm_layout import HAS_CRC, READY, SLOT_MAGIC, Layout, SlotHeader
from services.connectors.shm_segment import Segment, attach_segment


@dataclass(frozen=True)
class ShmRef:
    """A parsed shm handle."""

    key: str
    segment: str
    slot: int
    gen: int
    offset: int
    length: int
    specs: list[TensorSpec]
    cuda: list[dict[str, Any]]

    @classmethod
    def from_handle(cls, h: dict[str, Any]) -> ShmRef:
        if not isinstance(h, dict) or h.get("backend") != "shm":
            raise EntryCorrupt(f"not an shm handle: {h!r:.200}")
        try:
            ref = cls(str(h["key"]), str(h["segment"]), int(h["slot"]), int(h["generation"]),
                      int(h["offset"]), int(h["length"]), specs_from(h["tensors"]), list(h.get("cuda", [])))
        except (KeyError, TypeError, ValueError) as exc:
            raise EntryCorrupt(f"malformed shm handle: {exc!r}") from None
        if "/" in ref.segment or any(s.offset + s.nbytes > ref.length for s in ref.specs):
            raise EntryCorrupt(f"malformed shm handle for {ref.key!r}")
        return ref


class ShmReader:
    def __init__(self, verify_checksum: bool) -> None:
        self._verify = verify_checksum
        self._segments: dict[str, tuple[Segment, Layout]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def view(self, ref: ShmRef) -> Iterator[dict[str, torch.Tensor]]:
        """Tensors viewing the segment; checked again when the block ends without an exception."""
        seg, layout = self._attach(ref)
        header = self._check(seg, layout, ref)
        views = {s.name: tensor_at(seg.buf, s, ref.offset) for s in ref.specs}
        if self._verify and header.flags & HAS_CRC:
            self._verify_crc(ref, views, header.crc)
        yield views
        self._check(seg, layout, ref, after=True)

    def mark_consumed(self, ref: ShmRef) -> None:
        try:
            seg, layout = self._attach(ref)
            self._check(seg, layout, ref)
        except (EntryMissing, EntryCorrupt):
            return  # nothing left to release
        layout.mark_consumed(seg.mm, ref.slot, ref.gen)

    def _attach(self, ref: ShmRef) -> tuple[Segment, Layout]:
        with self._lock:
            cached = self._segments.get(ref.segment)
            if cached is not None and cached[0].is_current():
                return cached
            if cached is not None:
                self._segments.pop(ref.segment)[0].close()
            seg = attach_segment(ref.segment)
            layout = Layout.read_header(seg.mm)
            if layout is None:
                seg.close()
                raise EntryCorrupt(f"shm segment {ref.segment} has no valid pool header")
            self._segments[ref.segment] = (seg, layout)
            return seg, layout

    def _check(self, seg: Segment, layout: Layout, ref: ShmRef, after: bool = False) -> SlotHeader:
        if not 0 <= ref.slot < layout.num_slots or not (
                layout.data_start <= ref.offset and ref.offset + ref.length <= layout.total_size):
            raise EntryCorrupt(f"handle for {ref.key!r} points outside segment {ref.segment}")
        h = layout.read_slot(seg.mm, ref.slot)
        if h.magic != SLOT_MAGIC:
            raise EntryCorrupt(f"slot header of {ref.key!r} in {ref.segment} is damaged")
        if h.gen != ref.gen or h.state != READY:
            raise EntryMissing(f"entry {ref.key!r} was freed, evicted or overwritten")
        if not after and h.expires_at <= time.monotonic():
            raise EntryMissing(f"entry {ref.key!r} expired")
        if h.key_hash != key_hash(ref.key) or h.offset != ref.offset or h.length != ref.length:
            raise EntryCorrupt(f"slot header of {ref.key!r} does not match its handle")
        return h

    def _verify_crc(self, ref: ShmRef, tensors: dict[str, torch.Tensor], expected: int) -> None:
        if crc_of(byte_view(t) for t in tensors.values()) != expected:
            raise EntryCorrupt(f"checksum mismatch for {ref.key!r}")

    def close(self) -> None:
        with self._lock:
            for seg, _ in self._segments.values():
                seg.close()
            self._segments.clear()
