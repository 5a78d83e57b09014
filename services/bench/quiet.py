"""Wait until the machine's CPUs are quiet: what `epd bench --compare --settle-s` does between sides.

Two servers on one box, measured alternately, must not measure each other: a server that keeps its
cores busy after answering (vLLM's CPU engine spins about a second after each request, measured in
docs/benchmarks.md) would slow whichever side's requests come right after it.  Before each side's
part of a round the runner waits until the CPUs were at least `idle_fraction` idle over a `window_s`
window, or `max_s` passed.  Linux's /proc/stat is the source; where it cannot be read the wait is a
plain `max_s` sleep.
"""

from __future__ import annotations

import asyncio
import time

PROC_STAT = "/proc/stat"


def _cpu_times() -> tuple[int, int] | None:
    """(idle + iowait jiffies, all jiffies) of the machine's CPUs, or None where /proc/stat is unreadable."""
    try:
        with open(PROC_STAT) as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return idle, sum(values[:8])


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
