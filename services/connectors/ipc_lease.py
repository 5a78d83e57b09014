"""Reference counts of IPC entries across processes: a consumer's lease is a read lock on one byte of the pool.

A consumer that opens an entry's device tensors (services/connectors/ipc.py) holds a shared lock on the byte
at the entry's slot index of the producer's pool segment file, for as long as it reads them; the producer
frees an entry's device memory only when no such lock is held (`is_leased`).  So any number of consumers can
open one handle, and the memory goes when the last one is done.  The locks are open-file-description locks
(F_OFD_SETLK, Linux >= 3.15): they belong to the consumer's own descriptor of the file, so nothing else the
process does with that file drops them, and the kernel drops them when the consumer dies, however it dies: a
crashed reader cannot pin an entry.  (They are independent of the producer's liveness flock, shm_segment.py.)
Within one process several views of one entry share one lock (`Leases` counts them).

The protocol, race-free whatever the interleaving:
- consumer: take the lock, *then* check the slot header (READY, its generation), open, read, and give the
  lock back once its reads completed (`release_when`: a GPU reads asynchronously, so the lease waits on an
  event rather than the host waiting on the GPU);
- producer: mark the slot FREE, *then* test the lock; a held lock keeps the entry's slot and device tensors
  (draining, services/connectors/shm_pool.py) until a later test finds it free.
A consumer that checked the header before the producer's mark took its lock before the producer's test (so
the test sees it); one that checks after the mark finds the slot freed (EntryMissing) and lets go.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from collections.abc import Callable

from services.connectors.base import EntryMissing
from services.connectors.shm_segment import segment_path

# struct flock on Linux x86-64 and aarch64: l_type, l_whence, (pad), l_start, l_len, l_pid, (pad)
_FLOCK = struct.Struct("@hhqqi4x")
assert _FLOCK.size == 32, "struct flock is 32 bytes on the 64-bit Linux targets epd supports"


def _flock(fd: int, command: int, kind: int, slot: int) -> int:
    """The lock type `command` reports (F_OFD_GETLK) or sets, on the byte at offset `slot`."""
    answer = fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, slot, 1, 0))
    return int(_FLOCK.unpack(answer)[0])


def is_leased(fd: int, slot: int) -> bool:
    """(Producer.) Whether any consumer holds a lease on `slot` of the segment open as `fd`."""
    return _flock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, slot) != fcntl.F_UNLCK


class Leases:
    """This process's leases on other processes' pool slots: one lock per (segment, slot), counted."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._held: dict[tuple[str, int], int] = {}
        self._pending: list[tuple[Callable[[], bool], tuple[str, int]]] = []
        self._lock = threading.Lock()

    def acquire(self, segment: str, slot: int) -> None:
        """Lease `slot` of `segment` (before its header is checked); EntryMissing if the segment is gone."""
        key = (segment, slot)
        with self._lock:
            if self._held.get(key, 0) == 0:
                fd = self._fds.get(segment)
                if fd is None:
                    try:
                        fd = self._fds[segment] = os.open(segment_path(segment), os.O_RDONLY)
                    except FileNotFoundError:
                        raise EntryMissing(f"shm segment {segment} is gone (its producer closed or exited)") from None
                # never blocks: producers only test with F_OFD_GETLK, no one takes a write lock
                _flock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, slot)
            self._held[key] = self._held.get(key, 0) + 1
        self.reap()

    def release_when(self, segment: str, slot: int, done: Callable[[], bool]) -> None:
        """Give the lease back once `done()` (the reads of the view that took it completed)."""
        with self._lock:
            self._pending.append((done, (segment, slot)))
        self.reap()

    def reap(self) -> int:
        """Give back every lease whose reads completed; the number still waiting (the watcher calls this too)."""
        with self._lock:
            waiting = []
            for done, key in self._pending:
                if done():
                    self._drop(key)
                else:
                    waiting.append((done, key))
            self._pending = waiting
            return len(waiting)

    def held(self, segment: str, slot: int) -> int:
        """How many open views of this process lease `slot` of `segment` (tests)."""
        with self._lock:
            return self._held.get((segment, slot), 0)

    def _drop(self, key: tuple[str, int]) -> None:
        count = self._held.get(key, 0) - 1
        if count > 0:
            self._held[key] = count
            return
        self._held.pop(key, None)
        segment, slot = key
        fd = self._fds.get(segment)
        if fd is None:
            return
        if any(s == segment for s, _ in self._held):
            _flock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, slot)
        else:   # its last lease: closing the descriptor drops the lock
            os.close(self._fds.pop(segment))

    def close(self) -> None:
        """Drop every lease (closing the descriptors releases their locks)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._held.clear()
            self._pending.clear()
