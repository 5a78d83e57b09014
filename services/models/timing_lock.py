"""One start-up kernel timing at a time on this machine (services/models/kernel_choices.py, for prepack.py and
fused_mlp.py)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_LOCK_WAIT_S = 120.0          # how long a role waits for another's start-up timing


@contextlib.contextmanager
def timing_lock(wait_s: float | None = None) -> Iterator[bool]:
    """One start-up timing at a time on this machine (all users' epd processes of this uid).

    `epd serve` starts encode, prefill and decode together; timed side by side, each one's OpenMP
    threads wait at barriers for threads the others preempted, while single-threaded F.linear does
    not, and auto picked F.linear for decode at 0.23x-0.81x where alone it measures the panel kernel
    2.4x faster.  Yields True when the lock was taken, False when `wait_s` (default 120 s) passed first
    (then it times anyway, and says so); the lock goes when the process does, even killed."""
    wait_s = _LOCK_WAIT_S if wait_s is None else wait_s
    path = os.path.join(tempfile.gettempdir(), f"epd-linear-timing-{os.getuid()}.lock")
    with open(path, "a") as handle:
        deadline = time.monotonic() + wait_s
        while not _try_flock(handle):
            if time.monotonic() >= deadline:
                logger.warning("linear kernel timing: another process held %s for %.0f s; timing anyway",
                               path, wait_s)
                yield False
                return
            time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _try_flock(handle: Any) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
