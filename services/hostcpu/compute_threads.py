"""One OpenMP team per model role process: only the engine's compute thread runs torch on several threads.

Why (measured, benchmarks/omp_team.py): libgomp gives every OS thread that starts a parallel region a
team of its own.  A role process had two: the main thread's (model loading and the start-up kernel
timing ran there, and the event loop's tensor copies kept it) and the engine thread's.  Once more
OpenMP threads exist than cores, libgomp stops spin-waiting between parallel regions ("throttled"),
so each of the hundreds of regions of a forward pays a sleeping thread's wake-up.  In one process on 2
cores, the medium model's vision forward took 63 ms in the main thread and 84 ms in a worker thread
started after the main thread had used torch; element-wise ops were 1.6x slower; the same worker
alone was as fast as the main thread.

So, for the roles that `role_main` starts (`apply` below runs before torch is imported):
- every other thread runs torch on one thread (`OMP_NUM_THREADS=MKL_NUM_THREADS=1`, and `single()`
  in the main thread and in the event loop's default executor's threads): the event loop, `to_thread`
  helpers and the main thread's start-up work never fork a team;
- each engine thread calls `enter()` first: it then runs torch (and MKL) on `count()` threads —
  `--role-threads` for the role, else OMP_NUM_THREADS as the process found it (the Kubernetes
  manifests set it to the CPU limit), else the CPUs this process may use;
- start-up work that must run on those threads (the linear kernels' timing) runs in a short-lived
  thread (`run_in_fresh_thread`): its team goes when the thread does.

Outside a role process (tests, benchmarks that build engines in process) nothing is set: `count()` is
torch's default and `enter()` keeps it.  `--single-omp-team off` keeps the old behaviour.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

ENV = "EPD_COMPUTE_THREADS"
LONG_ENV = "EPD_LONG_COMPUTE_THREADS"   # prefill's threads while it runs a chunked prompt (--role-threads prefill-long)
T = TypeVar("T")


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def apply(threads: int | None) -> str:
    """Before torch is imported: one torch thread by default, `threads` (else an OMP_NUM_THREADS the
    operator set, as the Kubernetes manifests do to match a CPU limit; else every usable CPU) for the
    engine threads that call `enter()`.  Returns the summary for the start-up log."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    count = threads or (int(given) if given.isdigit() and int(given) > 0 else 0) or cpus()
    os.environ[ENV] = str(count)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    return f"one OpenMP team: compute threads={count}, other threads 1"


def count(long: bool = False) -> int:
    """The torch threads an engine thread runs with (`long`: for a chunked prompt's forward, where
    --role-threads prefill-long sets its own)."""
    value = os.environ.get(LONG_ENV, "") if long else ""
    value = value if value.isdigit() and int(value) > 0 else os.environ.get(ENV, "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    import torch

    return torch.get_num_threads()


SMALL_FORWARD_FLOPS = 1.0e9
"""In a role process a forward estimated under this many FLOPs (services/models/forward_cost.py) runs on one
thread: ~4 ms of one core here, where a two-thread forward after its cores idled can lose more than that to
waking its worker at every parallel region."""
INLINE_FORWARD_FLOPS = 0.25e9
"""An idle engine runs a forward estimated under this many FLOPs on its caller's thread (the role's event loop),
not its worker: ~1 ms of one core here plus the forward's per-operator cost (the tiny model's forwards, 0.04-0.06
GFLOP: ~2 ms), against ~0.3 ms for the two thread wake-ups of a hand-off to the worker and back."""


def use_for(flops: float, long: bool = False) -> None:
    """The calling engine thread's torch threads for a forward of about `flops`: one when it is small (in a role
    process, where `apply` ran), else `count(long)`."""
    import torch

    wanted = 1 if ENV in os.environ and flops < SMALL_FORWARD_FLOPS else count(long)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def use(long: bool = False) -> None:
    """The calling engine thread runs torch on `count(long)` threads from here on (no-op when it already does)."""
    import torch

    wanted = count(long)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def _libgomp() -> object | None:
    """The OpenMP runtime torch loaded (its per-thread `omp_set_num_threads`), or None."""
    global _GOMP
    if _GOMP is None:
        import ctypes

        try:
            with open("/proc/self/maps") as maps:
                paths = sorted({line.split()[-1] for line in maps if "libgomp" in line and "/" in line})
            _GOMP = ctypes.CDLL(paths[0]) if paths else False
        except OSError:
            _GOMP = False
    return _GOMP or None


_GOMP: object | None = None


def single() -> None:
    """Make the calling thread run torch on one thread, without touching torch's process-wide count
    (which `enter` sets for the engine thread) or MKL's.  torch sizes a thread's OpenMP count lazily on
    its first parallel call, from that process-wide count: so the lazy step runs first, then this
    thread's own OpenMP count is set to 1."""
    if ENV not in os.environ:
        return
    import torch

    torch.get_num_threads()   # torch's lazy per-thread initialisation, now rather than later
    gomp = _libgomp()
    if gomp is not None:
        gomp.omp_set_num_threads(1)   # type: ignore[attr-defined]


def helper_executor(max_workers: int | None = None) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor whose threads are `single()` (the event loop's default executor in a role)."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="epd-helper", initializer=single)


def enter() -> int:
    """Make the calling thread a compute thread (torch and MKL on `count()` threads); returns the count."""
    import torch

    threads = count()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def run_in_fresh_thread(fn: Callable[[], T], name: str = "epd-compute") -> T:
    """fn() on a new compute thread that ends with it (and with it its OpenMP team); exceptions propagate."""
    if ENV not in os.environ:      # not a role process: nothing to keep apart
        return fn()
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            enter()
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            error.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
