"""The producer side of the shm backend: one pre-faulted segment, entries allocated inside it.

Only the owning process writes entries (consumers write nothing but the
consumed mark).  A write is three steps: `reserve` (room made, slot marked
WRITING with a new generation), the payload copy into the extent (done by the
caller without holding the store's lock: `put` copies the given tensors,
`put_into` lets the producer fill views of the extent), then `publish` (crc,
slot READY, entry visible to lookups) or `abort`.  Readers reject a slot that
is not READY with their generation, so the seqlock holds for both.

Entries are kept in LRU order; room for a new entry is made by first
reclaiming expired and consumed entries, then evicting the least recently
used ones.  `bytes_used` (aligned payload bytes plus any extra charge, e.g.
CUDA tensors kept alive for IPC) never exceeds the capacity.

An entry with device tensors (`keep`, handed out by IPC handle) that is freed
while a consumer still holds a lease on its slot (services/connectors/
ipc_lease.py) is *draining*: it is gone for lookups and readers, but its slot,
its device tensors and their charge stay until a later `reclaim` finds no
lease left; only then does the device memory go back.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from services.connectors.base import ConnectorError
from services.connectors.codec import TensorSpec, align_up, bytes_at, crc_of, key_hash
from services.connectors.ipc_lease import is_leased
from services.connectors.shm_alloc import ExtentAllocator, SlotAllocator
from services.connectors.shm_layout import HAS_CRC, SLOT_MAGIC, Layout, SlotHeader
from services.connectors.shm_segment import Segment, create_segment, unlink_segment


@dataclass
class PoolEntry:
    key: str
    slot: int
    offset: int  # absolute byte offset of the payload in the segment
    size: int  # bytes reserved in the data region
    gen: int
    expires_at: float
    charge: int  # bytes counted against the capacity
    specs: list[TensorSpec]
    length: int
    crc: int | None = None
    keep: list[Any] = field(default_factory=list)  # CUDA tensors kept alive for IPC consumers
    cuda: list[dict[str, Any]] = field(default_factory=list)  # their IPC descriptions, for lookup()


class ShmPool:
    def __init__(self, name: str, capacity: int, ttl_s: float, use_crc: bool) -> None:
        self.layout = Layout.for_capacity(capacity)
        self.segment: Segment = create_segment(name, self.layout.total_size)
        self.layout.write_header(self.segment.mm)
        self._extents = ExtentAllocator(capacity)
        self._slots = SlotAllocator(self.layout.num_slots)
        self._entries: OrderedDict[str, PoolEntry] = OrderedDict()
        self._draining: list[PoolEntry] = []   # freed, device tensors still leased by a consumer
        self._ttl_s, self._use_crc = ttl_s, use_crc
        self._next_gen = 1
        self._owner_pid = os.getpid()
        self.bytes_used = 0
        self.evictions = 0

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def reserve(self, key: str, specs: list[TensorSpec], length: int, extra_charge: int = 0,
                keep: list[Any] | None = None) -> PoolEntry:
        """Room for an entry of `specs`, its slot marked WRITING; the caller fills the extent, then publishes."""
        size = align_up(length)
        charge = size + extra_charge
        if charge > self.layout.capacity:
            raise ConnectorError(f"entry {key!r} needs {charge} bytes, more than the store capacity "
                                 f"{self.layout.capacity}; raise capacity_bytes")
        self.free(key)
        slot, offset = self._make_room(size, charge)
        entry = PoolEntry(key, slot, self.layout.data_start + offset, size, self._next_gen,
                          time.monotonic() + self._ttl_s, charge, specs, length, keep=keep or [])
        self._next_gen += 1
        self.bytes_used += charge  # counted while it is filled, so the capacity holds
        header = SlotHeader(SLOT_MAGIC, 0, entry.gen, key_hash(key), entry.offset, entry.length, 0, 0, 0,
                            entry.expires_at)
        self.layout.begin_write(self.segment.mm, entry.slot, header)
        return entry

    def publish(self, entry: PoolEntry) -> PoolEntry:
        """Make a filled entry readable (crc first, then READY) and visible to lookups."""
        if self._use_crc:
            entry.crc = crc_of(bytes_at(self.segment.buf, s, entry.offset) for s in entry.specs)
        self.layout.publish(self.segment.mm, entry.slot, entry.crc or 0, HAS_CRC if self._use_crc else 0)
        self.free(entry.key)  # a concurrent write of the same key published first: the later one wins
        self._entries[entry.key] = entry
        return entry

    def abort(self, entry: PoolEntry) -> None:
        """Give back a reserved entry whose fill failed."""
        self._release(entry)

    def find(self, key: str) -> PoolEntry | None:
        """The live entry for `key` (now most recently used), or None; drops it if expired or consumed."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._is_stale(entry, time.monotonic()):
            self.free(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def entry_for(self, slot: int, gen: int) -> PoolEntry | None:
        return next((e for e in self._entries.values() if e.slot == slot and e.gen == gen), None)

    def free(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._release(entry)
        return True

    @property
    def num_draining(self) -> int:
        """Freed entries whose device tensors a consumer still reads."""
        return len(self._draining)

    def _release(self, entry: PoolEntry) -> None:
        self.layout.mark_free(self.segment.mm, entry.slot)  # before the extent can be reused; before the lease test
        self._extents.release(entry.offset - self.layout.data_start, entry.size)
        if entry.keep and self.segment.fd is not None and is_leased(self.segment.fd, entry.slot):
            self._draining.append(entry)   # slot, device tensors and charge kept until the last lease goes
            return
        self._drop(entry)

    def _drop(self, entry: PoolEntry) -> None:
        self._slots.release(entry.slot)
        self.bytes_used -= entry.charge
        entry.keep.clear()

    def reclaim(self) -> None:
        """Free every expired entry and every entry a consumer marked consumed; drop the draining entries no
        consumer leases any more."""
        now = time.monotonic()
        for key in [k for k, e in self._entries.items() if self._is_stale(e, now)]:
            self.free(key)
        if self._draining and self.segment.fd is not None:
            fd, draining, self._draining = self.segment.fd, self._draining, []
            for entry in draining:
                if is_leased(fd, entry.slot):
                    self._draining.append(entry)
                else:
                    self._drop(entry)

    def _is_stale(self, entry: PoolEntry, now: float) -> bool:
        if entry.expires_at <= now:
            return True
        return self.layout.read_slot(self.segment.mm, entry.slot).consumed_gen == entry.gen

    def _make_room(self, size: int, charge: int) -> tuple[int, int]:
        reclaimed = False
        while True:
            found = self._try_allocate(size, charge)
            if found is not None:
                return found
            if not reclaimed:
                self.reclaim()
                reclaimed = True
            elif self._entries:
                self.free(next(iter(self._entries)))
                self.evictions += 1
            elif self._draining:   # the rest is device memory consumers still read: refuse, never wait
                raise ConnectorError(f"shm pool {self.name} cannot place {charge} bytes: {len(self._draining)} "
                                     "freed entries are still read by consumers (raise the store's capacity)")
            else:  # cannot happen while charge <= capacity; guards against a bookkeeping bug looping
                raise ConnectorError(f"shm pool {self.name} cannot place {size} bytes")

    def _try_allocate(self, size: int, charge: int) -> tuple[int, int] | None:
        if self.bytes_used + charge > self.layout.capacity:
            return None
        slot = self._slots.allocate()
        if slot is None:
            return None
        offset = self._extents.allocate(size)
        if offset is None:
            self._slots.release(slot)
            return None
        return slot, offset

    def close(self) -> None:
        """Unlink the segment (attached consumers get EntryMissing) and unmap it."""
        self._entries.clear()
        self._draining.clear()
        if os.getpid() == self._owner_pid:  # a forked child exiting must not unlink its parent's pool
            unlink_segment(self.name)
        self.segment.close()
