"""How a role process shares the CPU: torch threads, the OpenMP wait policy, and OS priority.

Called once by `services.runtime.role_main.run` at start-up, before torch is imported (the OpenMP
runtime reads its environment when it loads), so it applies the same way to `epd serve`'s
children (which inherit the config through EPD_* variables) and to roles started alone.

Why: on one machine encode, prefill and decode are separate processes sharing the cores, each
with torch's default of one thread per core; when two are busy their threads contend, and
libgomp's threads spin-wait after each parallel region, taking cores the other process could
use.  The knobs, all flags (docs/configuration.md):

- `--role-threads`: "" (torch's default), "N" for every role, or "prefill=2,decode=2,...";
  with `--single-omp-team on` (default) this is the engine thread's count, every other thread of a
  model role runs torch on one (services/hostcpu/compute_threads.py says why);
- GOMP_SPINCOUNT (no flag): libgomp's default (300000 spins: ~15 ms where a pause instruction takes ~140
  cycles) except 10000 for `epd serve`'s model roles with one OpenMP team each: between the parallel
  regions of a forward (tens of microseconds) a thread still catches the next region spinning, but an idle
  role no longer spins through the others' time.  libgomp's own variables (GOMP_SPINCOUNT,
  OMP_WAIT_POLICY) set in the environment are left as they are: that is how to change the wait policy;
- `--role-nice`: niceness added per role; "auto" (default) is "decode=15,decode-long=5,prefill-long=19" for the
  children of `epd serve` (one machine: short prompts' encode and prefill run well ahead of decode's steps, so new
  requests join the decode batch sooner; under Poisson arrivals its TTFT is mostly below decode=5's and its TPOT
  above, on two shapes: docs/benchmarks.md "open-loop-nice" and "open-loop-nice-deep"; while a long (chunked) prompt
  prefills, decode's group goes back to 5 and the prefill's to 19, so decode's per-token latency holds; both
  measured in docs/benchmarks.md, "Decode TPOT while a long prompt prefills") and nothing for a role started alone
  (its own pod or machine). Raising niceness needs no privilege; a negative value needs CAP_SYS_NICE and is skipped
  with a warning otherwise. A role that leads its own session (as under `epd serve`) also sets its autogroup's
  niceness: with session autogroups, niceness alone does not weigh between processes of different sessions.
  `prefill-long=N` is prefill's autogroup niceness while a forward carries a prompt longer than
  `--max-num-batched-tokens` (one that is chunked); `decode-long=N` is decode's while any prefill of the cluster
  does, which decode reads before each step from a flag board `epd serve` puts in /dev/shm (a byte per prefill
  instance). A group's niceness between 0 and 19 may move either way without privilege; the kernel takes one change
  per 100 ms (EAGAIN otherwise: the role tries again at its next forward or step).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys

from services.config import EpdConfig

logger = logging.getLogger(__name__)

SERVE_CHILD = "EPD_SERVE_CHILD"          # set by `epd serve` (services.runtime.launch) in its role processes
MODEL_ROLES = ("encode", "prefill", "decode")   # the roles with torch engines (compute_threads.py)
SERVE_SPIN = 10000   # --omp-spin-count auto under `epd serve` (benchmarks/omp_team.py measures it)
SERVE_NICE = "decode=15,decode-long=5,prefill-long=19"   # role_nice "auto" there (docs/benchmarks.md says why)
LONG_BOARD_ENV = "EPD_LONG_PREFILL_BOARD"   # `epd serve`'s flag file: which prefill runs a chunked prompt
LONG_SLOT_ENV = "EPD_LONG_PREFILL_SLOT"     # this prefill's byte in it
LONG_BOARD_BYTES = 64
# this role's autogroup niceness: "base", "long" (prefill: while its forward carries a chunked prompt; decode:
# while any prefill's does), "now"; set by apply, read per forward or step
_GROUP: dict[str, int] = {}
_LONG: dict[str, object] = {}     # the flag board: "map" (mmap), "slot" (prefill's byte)


def role_values(raw: str, role: str) -> int | None:
    """"4" -> 4 for every role; "prefill=2,decode=1" -> that role's value; None when not given."""
    raw = raw.strip()
    if not raw:
        return None
    if "=" not in raw:
        return int(raw)
    for part in raw.split(","):
        name, _, value = part.partition("=")
        if name.strip() == role:
            return int(value)
    return None


def spin_count(config: EpdConfig, role: str) -> int | None:
    """GOMP_SPINCOUNT for `role`, or None to leave libgomp's default (or what the environment sets)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return None
    if config.cpu.single_omp_team == "on" and role in MODEL_ROLES and os.environ.get(SERVE_CHILD):
        return SERVE_SPIN
    return None


def _autogroup_nice(value: int) -> list[str]:
    """Give this process's autogroup the same niceness, when the autogroup is this process's own.

    Where the kernel groups processes by session (CONFIG_SCHED_AUTOGROUP, on in most distributions'
    kernels and in this project's machines), the scheduler first shares the CPU equally between
    autogroups, and a process's niceness only weighs inside its own.  `epd serve` starts each role in a
    session of its own, so `os.nice` alone did nothing between roles: a niced prefill still took half the
    cores from decode (docs/benchmarks.md, "Decode TPOT while a long prompt prefills").  Only a session
    leader's autogroup is its own; a role started from a shell leaves the shell's group alone."""
    path = "/proc/self/autogroup"
    if os.getsid(0) != os.getpid() or not os.path.exists(path):
        return []
    try:
        with open(path, "w") as group:
            group.write(str(value))
    except OSError as exc:  # a value >= 0 needs no privilege; a negative one needs CAP_SYS_NICE
        if exc.errno != errno.EAGAIN:   # EAGAIN: the kernel takes one change per 100 ms; the caller tries again
            logger.warning("could not set this role's autogroup niceness to %d: %s", value, exc)
        return []
    return [f"autogroup nice={value}"]


def long_prompt_running(running: bool) -> None:
    """Prefill's engine, before each forward: its autogroup's niceness for a forward of a long (chunked)
    prompt, or back to its base.  One write when it changes; nothing where apply set no long value.  A long
    prompt's forwards yield the cores to decode (its TPOT stays flat) while short prompts keep prefill's
    base share (c=16 throughput: docs/benchmarks.md, "Decode TPOT while a long prompt prefills")."""
    board, slot = _LONG.get("map"), _LONG.get("slot")
    if isinstance(board, mmap.mmap | bytearray) and isinstance(slot, int):
        board[slot] = 1 if running else 0   # decode follows it (follow_long_prefill)
    if not _GROUP:
        return
    value = _GROUP["long"] if running else _GROUP["base"]
    if value != _GROUP["now"] and _autogroup_nice(value):
        _GROUP["now"] = value


def long_board() -> mmap.mmap | None:
    """The long-prompt board where this process opened one (decode's steps do not yield to a long prompt)."""
    board = _LONG.get("map")
    return board if isinstance(board, mmap.mmap) else None


def long_prompt_prefilling() -> bool:
    board = long_board()
    return board is not None and any(board[:LONG_BOARD_BYTES])


def follow_long_prefill() -> None:
    """Decode's engine, before each step: its autogroup's niceness back to decode-long while any prefill of the
    cluster runs a chunked prompt (that prefill's own group is at prefill-long then), to its base after.  So
    short prompts' encode and prefill run ahead of decode (base 15: new requests join the batch sooner), and a
    long prompt's prefill behind it (decode-long 5 against prefill-long 19: its per-token latency holds)."""
    board = _LONG.get("map")
    if board is None or not _GROUP:
        return
    running = any(board[:LONG_BOARD_BYTES])   # type: ignore[index]
    value = _GROUP["long"] if running else _GROUP["base"]
    if value != _GROUP["now"] and _autogroup_nice(value):
        _GROUP["now"] = value


def create_long_board(path: str) -> str:
    """`epd serve`'s flag file (one byte per prefill instance), zeroed."""
    with open(path, "wb") as file:
        file.write(bytes(LONG_BOARD_BYTES))
    return path


def _open_long_board(role: str) -> None:
    path = os.environ.get(LONG_BOARD_ENV, "")
    slot = os.environ.get(LONG_SLOT_ENV, "")
    if not path or role not in ("prefill", "decode") or not os.path.exists(path):
        return
    if role == "prefill" and not (slot.isdigit() and int(slot) < LONG_BOARD_BYTES):
        return
    with open(path, "r+b") as file:
        _LONG["map"] = mmap.mmap(file.fileno(), LONG_BOARD_BYTES)
    if role == "prefill":
        _LONG["slot"] = int(slot)


def apply(config: EpdConfig, role: str) -> str:
    """Set this process's threads, wait policy and niceness for `role`; returns a one-line summary."""
    done = []
    spin = spin_count(config, role)
    if spin is not None:
        os.environ["GOMP_SPINCOUNT"] = str(spin)
        done.append(f"GOMP_SPINCOUNT={spin}")
    threads = role_values(config.cpu.role_threads, role)
    if config.cpu.single_omp_team == "on" and role in MODEL_ROLES:
        from services.hostcpu import compute_threads

        done.append(compute_threads.apply(threads))
        long_threads = role_values(config.cpu.role_threads, "prefill-long") if "=" in config.cpu.role_threads else None
        if role == "prefill" and long_threads:
            os.environ[compute_threads.LONG_ENV] = str(long_threads)
            done.append(f"compute threads={long_threads} while a chunked prompt prefills")
    elif threads is not None:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules and sys.modules["torch"] is not None:
            sys.modules["torch"].set_num_threads(threads)
        done.append(f"threads={threads}")
    raw_nice = (SERVE_NICE if config.cpu.role_nice == "auto" and os.environ.get(SERVE_CHILD) else
                "" if config.cpu.role_nice == "auto" else config.cpu.role_nice)
    nice = role_values(raw_nice, role) or 0
    longer = role_values(raw_nice, f"{role}-long") if role in ("prefill", "decode") else None
    _open_long_board(role)   # prefill marks its chunked prompts, decode's steps do not yield to them
    if nice or longer is not None:   # prefill-long applies with prefill's own niceness 0 too
        try:
            if nice:
                done.append(f"nice={os.nice(nice)}")
        except OSError as exc:
            logger.warning("could not change niceness by %d: %s", nice, exc)
        else:
            group = _autogroup_nice(os.nice(0))
            done.extend(group)
            if group and longer is not None:
                _GROUP.update(base=os.nice(0), long=max(0, min(19, os.nice(0) - nice + longer)), now=os.nice(0))
                done.append(f"autogroup nice={_GROUP['long']} while a chunked prompt prefills")
    if role in ("encode", "prefill", "decode"):
        from services.hostcpu import compute_lease

        lease = compute_lease.follow_from_env() if role == "decode" else compute_lease.configure_from_env()
        if lease:
            done.append(lease)
    summary = f"{role} cpu policy: " + (", ".join(done) or "defaults")
    logger.info(summary)
    return summary
