"""POSIX shared-memory segments under /dev/shm: naming, creation, attachment, sweeping.

We use os.open + mmap on both sides, not multiprocessing.shared_memory, whose
resource tracker unlinks a segment when any attaching process exits.  A name
carries the owner's pid and process start time (`<ns>-<purpose>-<instance>-
<pid>-<start>`), and the owner holds a shared flock on the file for its whole
life: `sweep_stale_segments` removes a segment only when its named owner is gone
(dead pid or reused pid) AND nobody holds the lock, so a live owner in another
pid namespace sharing /dev/shm is never swept.  Consumers use the same lock to
tell that the producer of a segment they mapped is gone (`producer_gone`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid
from dataclasses import dataclass

import numpy as np

from services.connectors.base import ConnectorError, EntryCorrupt, EntryMissing

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE
_INIT_SUFFIX = ".init"


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), None if not running
    (no such process, or a zombie: it has exited and released its lock, only its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] == b"Z" else int(fields[19])


def segment_name(namespace: str, purpose: str, instance_id: str) -> str:
    pid = os.getpid()
    return f"{namespace}-{purpose}-{instance_id}-{pid}-{process_start_time(pid)}"


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


@dataclass
class Segment:
    """One mapping of a segment; `buf` is a uint8 numpy array over the whole mapping."""

    name: str
    mm: mmap.mmap
    buf: np.ndarray
    inode: int
    fd: int | None = None  # only the owner keeps its fd open: it carries the liveness lock

    def is_current(self) -> bool:
        """The name still points at the file we mapped (not unlinked, not re-created)."""
        try:
            return os.stat(segment_path(self.name)).st_ino == self.inode
        except OSError:
            return False

    def close(self) -> None:
        self.buf = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):   # zero-copy views still alive: the mapping goes with the last
            self.mm.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def create_segment(name: str, size: int) -> Segment:
    """Create, size and pre-fault a segment, then publish it under `name` (fails if it exists)."""
    tmp = segment_path(name + _INIT_SUFFIX + "." + uuid.uuid4().hex[:8])
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise ConnectorError(f"cannot reserve {size} bytes in {SHM_DIR} for {name}: {exc} (in Kubernetes "
                                 "mount an emptyDir with medium: Memory at /dev/shm)") from None
        mm = mmap.mmap(fd, size)
        buf = np.frombuffer(mm, np.uint8)
        buf[::_PAGE] = 0  # touch every page now so the first put does not pay the page faults
        # link() publishes atomically and, unlike rename(), refuses to replace an existing name.
        os.link(tmp, segment_path(name))
    except FileExistsError:
        os.close(fd)
        raise ConnectorError(f"shm segment {name} already exists: instance_id must be unique") from None
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return Segment(name, mm, buf, os.fstat(fd).st_ino, fd)


def attach_segment(name: str) -> Segment:
    """Map an existing segment read-write (consumers write the consumed mark)."""
    try:
        fd = os.open(segment_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise EntryMissing(f"shm segment {name} is gone (its producer closed or exited)") from None
    try:
        size = os.fstat(fd).st_size
        if size < _PAGE:  # not a pool: too small to hold even the segment header
            raise EntryCorrupt(f"shm segment {name} is only {size} bytes")
        # MAP_POPULATE maps every page now: later reads do not fault page by page.
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        return Segment(name, mm, np.frombuffer(mm, np.uint8), os.fstat(fd).st_ino)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(name))


def _owner_of(name: str, namespace: str) -> tuple[int, int] | None:
    if not name.startswith(namespace + "-"):
        return None
    base = name.split(_INIT_SUFFIX, 1)[0]
    parts = base.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1]), int(parts[2])


def _remove_if_unlocked(name: str) -> bool:
    try:
        fd = os.open(segment_path(name), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # a live owner holds it (possibly from another pid namespace)
    try:
        os.unlink(segment_path(name))
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def producer_gone(seg: Segment) -> bool:
    """The producer of an attached segment is gone: its file was unlinked or replaced, or nobody holds its
    lock any more (the owner died without cleaning up: the file is unlinked here, as a sweep would)."""
    return not seg.is_current() or _remove_if_unlocked(seg.name)


def sweep_stale_segments(namespace: str = "epd") -> list[str]:
    """Unlink the segments of `namespace` whose owner process is gone; return their names."""
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        owner = _owner_of(name, namespace)
        if owner is None:
            continue
        pid, start = owner
        if process_start_time(pid) == start:
            continue
        if _remove_if_unlocked(name):
            removed.append(name)
    return removed
