"""The consumer side of the shm backend: cached attachments and verified reads by handle.

A read checks the entry's slot header before and after touching the payload
(see shm_layout): a generation or state change means the entry was freed,
evicted or overwritten meanwhile (EntryMissing); a header that is not ours or
does not describe the handle's entry is EntryCorrupt.  Attachments are cached
per segment and re-validated by inode on each read, so a segment that was
unlinked (producer closed, exited or was swept) reads as EntryMissing.

Liveness: a watcher thread (started with the first attachment) gives back the
IPC leases whose reads completed (ipc_lease.py) and checks every
LIVENESS_INTERVAL_S whether the producer of each cached attachment is gone
(segment unlinked or replaced, or its owner's flock released: a SIGKILLed
producer) and unmaps those no view is using, so a dead or restarted
producer's pool does not stay pinned in this process's memory.  Unmapping
waits for zero-copy tensors a caller kept past its `view` block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.connectors.base import EntryCorrupt, EntryMissing
from services.connectors.codec import TensorSpec, byte_view, crc_of, key_hash, specs_from, tensor_at
from services.connectors.ipc_lease import Leases
from services.connectors.shm_fence import ensure as ensure_fence
from services.connectors.shm_layout import HAS_CRC, READY, SLOT_MAGIC, Layout, SlotHeader
from services.connectors.shm_segment import Segment, attach_segment, producer_gone

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
LIVENESS_INTERVAL_S = 1.0


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
    def __init__(self, verify_checksum: bool, liveness_interval_s: float = LIVENESS_INTERVAL_S) -> None:
        ensure_fence()  # refuse to start where the seqlock cannot be fenced
        self._verify = verify_checksum
        self._segments: dict[str, tuple[Segment, Layout]] = {}
        self._in_use: dict[str, int] = {}  # views open per segment: never unmapped under a reader
        self._lock = threading.Lock()
        self._interval = liveness_interval_s
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.leases = Leases()   # this process's leases on other pools' IPC entries (ipc_lease.py)

    @contextmanager
    def view(self, ref: ShmRef) -> Iterator[dict[str, torch.Tensor]]:
        """Tensors viewing the segment; checked again when the block ends without an exception (unless the entry
        has no bytes here: its device tensors are the caller's lease's to protect, ipc_lease.py)."""
        seg, layout = self._attach(ref, hold=True)
        try:
            header = self._check(seg, layout, ref)
            views = {s.name: tensor_at(seg.buf, s, ref.offset) for s in ref.specs}
            if self._verify and header.flags & HAS_CRC:
                self._verify_crc(ref, views, header.crc)
            yield views
            if ref.specs:
                self._check(seg, layout, ref, after=True)
        finally:
            with self._lock:
                self._in_use[ref.segment] -= 1

    def mark_consumed(self, ref: ShmRef) -> None:
        try:
            seg, layout = self._attach(ref)
            self._check(seg, layout, ref)
        except (EntryMissing, EntryCorrupt):
            return  # nothing left to release
        layout.mark_consumed(seg.mm, ref.slot, ref.gen)

    def _attach(self, ref: ShmRef, hold: bool = False) -> tuple[Segment, Layout]:
        with self._lock:
            found = self._attached(ref.segment)
            if hold:
                self._in_use[ref.segment] = self._in_use.get(ref.segment, 0) + 1
            return found

    def _attached(self, name: str) -> tuple[Segment, Layout]:
        cached = self._segments.get(name)
        if cached is not None and cached[0].is_current():
            return cached
        if cached is not None and not self._in_use.get(name):
            self._segments.pop(name)[0].close()
        seg = attach_segment(name)
        layout = Layout.read_header(seg.mm)
        if layout is None:
            seg.close()
            raise EntryCorrupt(f"shm segment {name} has no valid pool header")
        self._segments[name] = (seg, layout)
        self._start_watching()
        return seg, layout

    # ---- liveness -----------------------------------------------------------------------------

    def drop_dead(self) -> list[str]:
        """Unmap every idle attachment whose producer is gone; their names."""
        with self._lock:
            dead = [name for name, (seg, _) in self._segments.items()
                    if not self._in_use.get(name) and producer_gone(seg)]
            for name in dead:
                self._segments.pop(name)[0].close()
                self._in_use.pop(name, None)
        for name in dead:
            log.info("unmapped shm segment %s: its producer is gone", name)
        return dead

    def _start_watching(self) -> None:
        if self._watcher is None and not self._stop.is_set():
            self._watcher = threading.Thread(target=self._watch, name="shm-liveness", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.leases.reap()   # leases whose GPU reads completed since their view closed
                self.drop_dead()
            except Exception:  # noqa: BLE001 - the watcher must outlive one odd segment; try again next round
                log.exception("shm liveness check failed")

    def _check(self, seg: Segment, layout: Layout, ref: ShmRef, after: bool = False) -> SlotHeader:
        if not 0 <= ref.slot < layout.num_slots or not (
                layout.data_start <= ref.offset and ref.offset + ref.length <= layout.total_size):
            raise EntryCorrupt(f"handle for {ref.key!r} points outside segment {ref.segment}")
        h = layout.read_end(seg.mm, ref.slot) if after else layout.read_begin(seg.mm, ref.slot)
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
        self._stop.set()
        self.leases.close()
        with self._lock:
            for seg, _ in self._segments.values():
                seg.close()
            self._segments.clear()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * self._interval + 1)
