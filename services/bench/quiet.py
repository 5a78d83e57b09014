"""Wait until the machine's CPUs are quiet: what `epd bench --compare --settle-s` does between sides.

Two servers on one box, measured alternately, must not measure each other: a server that keeps its
cores busy after answering (vLLM's CPU engine spins about a second after each request, measured in
docs/benchmarks.md) would slow whichever side's requests come right after it.  Before each side's
part of a round the runner waits until the CPUs were at least `idle_fraction` idle over a `window_s`
window, or `max_s` passed.  Linux's /proc/stat is the source (the CPUs of this process's affinity);
where it cannot be read the wait is a plain `max_s` sleep.
"""

from __future__ import annotations

import asyncio
import os
import time

PROC_STAT = "/proc/stat"


def _cpu_times() -> tuple[int, int] | None:
    """(idle + iowait jiffies, all jiffies) of the CPUs this process may run on (its affinity: a run pinned to
    some cores of a bigger host watches those), or None where /proc/stat is unreadable."""
    try:
        with open(PROC_STAT) as stat:
            lines = [line.split() for line in stat if line.startswith("cpu")]
    except OSError:
        return None
    mine = {f"cpu{n}" for n in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set()
    rows = [fields for fields in lines if fields[0] in mine] or [f for f in lines if f[0] == "cpu"]
    if not rows:
        return None
    idle = total = 0
    for fields in rows:
        values = [int(v) for v in fields[1:]]
        idle += values[3] + (values[4] if len(values) > 4 else 0)
        total += sum(values[:8])
    return idle, total


async def wait_quiet(max_s: float, idle_fraction: float = 0.9, window_s: float = 0.1) -> float:
    """Seconds waited until one `window_s` window had the CPUs >= `idle_fraction` idle (at most `max_s`)."""
    started = time.monotonic()
    if max_s <= 0:
        return 0.0
    before = _cpu_times()
    if before is None:
        await asyncio.sleep(max_s)
        return max_s
    while time.monotonic() - started < max_s:
        await asyncio.sleep(min(window_s, max(0.0, max_s - (time.monotonic() - started))))
        after = _cpu_times()
        if after is None:
            break
        idle, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and idle / total >= idle_fraction:
            break
        before = after
    return time.monotonic() - started
