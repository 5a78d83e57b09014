"""Byte layout of a pool segment and the seqlock protocol on its slot headers.

    [segment header: 1 page][slot table: num_slots x 64 B, page aligned][data: capacity bytes]

Each entry owns one slot (its header) and one extent of the data region.
Headers live apart from the data so a payload can never overwrite a header.

Seqlock: the owner marks a slot WRITING (and gives it a new generation) before
it writes any payload byte into the extent, and marks READY after; freeing or
evicting marks the slot FREE before the extent is reused.  A reader checks the
slot (READY, generation of its handle) before and after copying, so a copy
that raced with an eviction is detected.  Stores become visible in program
order on x86 (TSO); each state change is one aligned 4-byte store.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import NamedTuple

from services.connectors.codec import align_up

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
        SEGMENT.pack_into(buf, 0, SEGMENT_MAGIC, VERSION, self.num_slots, SLOT_SIZE, self.data_start,
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

    def begin_write(self, buf: mmap.mmap, index: int, header: SlotHeader) -> None:
        at = self.slot_at(index)
        _STATE.pack_into(buf, at + _STATE_AT, WRITING)  # invalidate first, then the rest
        SLOT.pack_into(buf, at, *header._replace(state=WRITING))

    def publish(self, buf: mmap.mmap, index: int, crc: int, flags: int) -> None:
        at = self.slot_at(index)
        _CRC.pack_into(buf, at + _CRC_AT, crc, flags)
        _STATE.pack_into(buf, at + _STATE_AT, READY)

    def mark_free(self, buf: mmap.mmap, index: int) -> None:
        _STATE.pack_into(buf, self.slot_at(index) + _STATE_AT, FREE)

    def mark_consumed(self, buf: mmap.mmap, index: int, gen: int) -> None:
        # Only this field is written by consumers; carrying the generation means a late mark can never
        # hit a newer entry that reused the slot.
        _CONSUMED.pack_into(buf, self.slot_at(index) + _CONSUMED_AT, gen)
