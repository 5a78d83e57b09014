"""services.runtime.heap.keep_freed_memory: MB-sized buffers freed by one request are reused by the next.

Two fresh processes do the same work as a large features request does in the coordinator's worker
threads (a 20 MB body copied, decoded, dropped, several times, from a thread pool); the one that called
keep_freed_memory first takes far fewer new pages (minor page faults) for it, which is what keeps a
request's GIL-holding copies from faulting fresh memory (tests/e2e/test_loop_lag.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORK = """
import resource, sys
from concurrent.futures import ThreadPoolExecutor
if sys.argv[1] == "keep":
    from services.runtime.heap import keep_freed_memory
    assert keep_freed_memory()

def request(_):
    body = bytearray(b"x" * (20 << 20))
    text = bytes(body).decode("ascii")
    del body, text

pool = ThreadPoolExecutor(4)
list(pool.map(request, range(2)))           # the first requests grow the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    list(pool.map(request, range(2)))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", WORK, mode], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_later_requests_reuse_the_pages_of_earlier_ones():
    default, kept = _faults("default"), _faults("keep")
    pages = 12 * 60 * (1 << 20) // 4096   # 12 requests x ~60 MB of buffers, in 4 KiB pages
    assert default > pages // 2, (default, pages)    # glibc's defaults: most buffers on fresh pages
    assert kept < default // 3, (kept, default)


def test_startup_done_freezes_what_start_up_made_and_turns_the_collector_back_on():
    code = """
import gc
from services.runtime.heap import startup_done
gc.disable()
kept = [[i] for i in range(50000)]
startup_done()
print(gc.isenabled(), gc.get_freeze_count() >= len(kept))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
