"""Byte layout of a pool segment and the seqlock protocol on its slot headers.

    [segment header: 1 page][slot table: num_slots x 64 B, page aligned][data: capacity bytes]

Each entry owns one slot (its header) and one extent of the data region.
Headers live apart from the data so a payload can never overwrite a header.

Seqlock: the owner marks a slot WRITING (and gives it a new generation) before
it writes any payload byte into the extent, and marks READY after; freeing or
evicting marks the slot FREE before the extent is reused.  A reader checks the
slot (READY, generation of its handle) before and after copying, so a copy
that raced with an eviction is detected.  Each state change is one aligned
4-byte store.  Memory order: a full fence (shm_fence; a no-op on x86's total
store order, a real barrier elsewhere) separates the invalidating store from
the payload stores, the payload stores from the publishing store, and, on the
reader's side, the first header read from the payload reads and those from the
second header read (`read_begin` / `read_end`).  A header is read with one
copy whose loads have no order among themselves, so each side also reads the
state word alone, fenced from the copy: the state read after the copy at the
start, before it at the end.  A READY state then always comes with its own
generation (the generation is written before READY, after WRITING).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import NamedTuple

from services.connectors.codec import align_up
from services.connectors.shm_fence import fence

SEGMENT_MAGIC = 0x50445045  # "EPDP"
SLOT_MAGIC = 0x53445045  # "EPDS"
VERSION = 1
FREE, WRITING, READY = 0, 1, 2
HAS_CRC = 1

SEGMENT = struct.Struct("<IIIIQQ")  # magic, version, num_slots, slot_size, data_start, capacity
# magic, state, gen, key_hash, offset, length, crc, flags, consumed_gen, expires_at (CLOCK_MONOTONIC)
SLOT = struct.Struct("<IIQQQQIIQd")
SLOT_SIZE = 64
_STATE = struct.Struct("<I")
_STATE_AT = 4
_CRC_AT = 40  # crc (u32) and flags (u32)
_CRC = struct.Struct("<II")
_CONSUMED_AT = 48
_CONSUMED = struct.Struct("<Q")


def _store(buf: mmap.mmap, at: int, fmt: struct.Struct, *values: object) -> None:
    """Write packed fields with one copy of the finished bytes.  Never `Struct.pack_into` on shared memory:
    CPython zero-fills the destination before packing field by field, so a concurrent reader could see a
    zero magic, state or generation that no writer ever stored (seen as "slot header damaged")."""
    buf[at:at + fmt.size] = fmt.pack(*values)


class SlotHeader(NamedTuple):
    magic: int
    state: int
    gen: int
    key_hash: int
    offset: int
    length: int
    crc: int
    flags: int
    consumed_gen: int
    expires_at: float


@dataclass(frozen=True)
class Layout:
    num_slots: int
    data_start: int
    capacity: int

    @classmethod
    def for_capacity(cls, capacity: int) -> Layout:
        # Roughly one slot per 4 KiB of data: plenty for embeddings and KV, small table for small pools.
        num_slots = max(256, min(65536, capacity // 4096))
        data_start = align_up(mmap.PAGESIZE + num_slots * SLOT_SIZE, mmap.PAGESIZE)
        return cls(num_slots, data_start, capacity)

    @property
    def total_size(self) -> int:
        return self.data_start + self.capacity

    def slot_at(self, index: int) -> int:
        return mmap.PAGESIZE + index * SLOT_SIZE

    def write_header(self, buf: mmap.mmap) -> None:
        _store(buf, 0, SEGMENT, SEGMENT_MAGIC, VERSION, self.num_slots, SLOT_SIZE, self.data_start,
                          self.capacity)

    @classmethod
    def read_header(cls, buf: mmap.mmap) -> Layout | None:
        """The layout a segment declares, or None if its header is not ours."""
        magic, version, num_slots, slot_size, data_start, capacity = SEGMENT.unpack_from(buf, 0)
        if magic != SEGMENT_MAGIC or version != VERSION or slot_size != SLOT_SIZE:
            return None
        layout = cls(num_slots, data_start, capacity)
        return layout if layout.total_size <= len(buf) else None

    def read_slot(self, buf: mmap.mmap, index: int) -> SlotHeader:
        return SlotHeader._make(SLOT.unpack_from(buf, self.slot_at(index)))

    def read_begin(self, buf: mmap.mmap, index: int) -> SlotHeader:
        """The slot header as a reader sees it before touching the payload; READY only if the state read
        again after the header (and a fence) is still READY, so the generation read belongs to it."""
        header = self.read_slot(buf, index)
        fence()  # the state re-read and the payload reads cannot move above the header read
        return header if self.state(buf, index) == READY else header._replace(state=WRITING)

    def read_end(self, buf: mmap.mmap, index: int) -> SlotHeader:
        """The slot header re-read after the payload (a change means the read may be torn); READY only if
        the state read before it (after a fence) was READY too, so a newer publication shows its generation."""
        fence()  # the payload reads cannot move below these reads
        state = self.state(buf, index)
        fence()
        header = self.read_slot(buf, index)
        return header if state == READY else header._replace(state=WRITING)

    def state(self, buf: mmap.mmap, index: int) -> int:
        return int(_STATE.unpack_from(buf, self.slot_at(index) + _STATE_AT)[0])

    def begin_write(self, buf: mmap.mmap, index: int, header: SlotHeader) -> None:
        at = self.slot_at(index)
        _store(buf, at + _STATE_AT, _STATE, WRITING)  # invalidate first, then the rest
        fence()
        _store(buf, at, SLOT, *header._replace(state=WRITING))

    def publish(self, buf: mmap.mmap, index: int, crc: int, flags: int) -> None:
        at = self.slot_at(index)
        _store(buf, at + _CRC_AT, _CRC, crc, flags)
        fence()  # the payload and the checksum are visible before the slot says READY
        _store(buf, at + _STATE_AT, _STATE, READY)

    def mark_free(self, buf: mmap.mmap, index: int) -> None:
        _store(buf, self.slot_at(index) + _STATE_AT, _STATE, FREE)
        fence()  # visible before any store that reuses the extent

    def mark_consumed(self, buf: mmap.mmap, index: int, gen: int) -> None:
        # Only this field is written by consumers; carrying the generation means a late mark can never
        # hit a newer entry that reused the slot.
        _store(buf, self.slot_at(index) + _CONSUMED_AT, _CONSUMED, gen)
