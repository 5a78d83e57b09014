"""A real process that holds the start-up timing lock (services/models/timing_lock.py) until it is killed."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def lock_held(folder: Path) -> Iterator[subprocess.Popen]:
    """Start a process that takes the lock, wait (60 s at most) until it holds it, kill it on exit."""
    held = folder / "held"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, time\n"
        "from services.models.timing_lock import timing_lock\n"
        "with timing_lock() as taken:\n"
        f"    pathlib.Path({str(held)!r}).write_text(str(taken))\n"
        "    time.sleep(120)\n")])
    try:
        deadline = time.monotonic() + 60
        while not held.exists():
            assert time.monotonic() < deadline and holder.poll() is None, "the holder did not take the lock"
            time.sleep(0.05)
        assert held.read_text() == "True"
        yield holder
    finally:
        holder.kill()
        holder.wait(30)
