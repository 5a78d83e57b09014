"""glibc keeps what a process frees for its next request instead of handing it back to the kernel.

A request through render or the coordinator makes MBs of short-lived buffers (a 1024x768 image: the
3 MB data URL, its decoded bytes, the decoded image, the 4.7 MB patches, their pickled copies between
render's processes).  With glibc's defaults (several arenas; blocks above a moving threshold mmapped
and unmapped on free; free heap trimmed) each one lands on fresh pages, a minor page fault per 4 KiB,
inside copies that hold the GIL.  Where a fresh page is slow, as in a VM whose host takes freed memory
back (free page reporting), that is the request's time: on this project's machines a render worker's
and render's own CPU per 1024x768 image tripled while another large process was resident (docs/
benchmarks.md, "Render's resize and page faults").  One arena, blocks up to 32 MB (glibc's ceiling) from the
heap, no trimming below 256 MB of free heap: later requests reuse pages already faulted in.

Applied by the coordinator and render's main and worker processes (not the model roles, whose compute
threads allocate per op and would contend for one arena).

Python's own heap at start-up (every role and the coordinator): `gc.disable()` first, `startup_done()` once built.
Importing torch and transformers and building the model make millions of objects that live as long as the
process; the cyclic GC's automatic collections rescan them again and again on the way (about a quarter of a
role's start-up CPU), to find next to no garbage.  So start-up runs without them, then freezes what it made out
of later collections, and turns the GC back on.  Without collecting first: one collection there found ~14,000
unreachable objects among 620,000-920,000 in each model role, freed no resident memory, and took 0.4-0.6 s,
the last of them on the cluster's start-up path (decode is ready last).
"""

from __future__ import annotations

import gc


def keep_freed_memory() -> bool:
    """Set glibc's malloc as above; False where the C library has no mallopt (musl)."""
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return all(mallopt(option, value) == 1 for option, value in
               ((m_arena_max, 1), (m_mmap_threshold, 32 << 20), (m_trim_threshold, 256 << 20)))


def startup_done() -> None:
    """Start-up is over: keep what it made out of every later collection (and out of the one at exit), and turn
    the automatic collections that start-up ran without back on."""
    gc.freeze()
    gc.enable()
