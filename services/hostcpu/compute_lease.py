"""One prompt-side forward at a time on this machine: encode's and prefill's forwards take turns (`--compute-lease`).

`epd serve` runs encode, prefill and decode on the same cores.  Each model role computes on an OpenMP team of
one thread per core, and a forward is hundreds of parallel regions, each ending at a barrier.  When encode's and
prefill's forwards run at once, four threads share two cores and every region waits for the thread the
scheduler preempted (services/models/timing_lock.py met the same at start-up: kernels timed side by side came
out 0.23x-0.81x of their speed alone).  With the lease the two roles' forwards take turns, each on all cores.
Decode does not take the lease: it follows it.  A decode step pauses at the start of each layer while a prompt-side
forward holds or waits for the lease, for at most YIELD_BUDGET_S a step (`follow_from_env`, the fused step's
epd_fused_yield_to, the eager step through `Follower.pause`).  Niceness alone did not keep decode off the cores: a
nice-15 team runs in every gap a prompt forward's threads leave, and, once running, keeps the core for a scheduler
slice while the prompt team waits at its next barrier (at 2 req/s under `vllm bench serve`, encode and prefill
forwards took 110 and 128 ms at epd@311e186, decode only niced, and 69 and 103 ms with it yielding among the
changes since: open_loop_stages.json).
vLLM's one scheduler gets the same order by running a new prompt's prefill before the next decode step.
A paused step sleeps 100 us, then twice as long each time up to 2 ms (PAUSE_S): with a fixed 100 us each decode
thread woke 10,000 times a second through the forward, and a woken thread takes a core from the forward's team
unless its niceness is far above theirs: the wake-ups cost most where decode is not niced far, as under
`--role-nice decode=0` (benchmarks/kernel_gains.py runs it so).

The lease is an exclusive flock on a small file in /dev/shm (`epd serve` makes one per cluster and gives its path
to the encode, prefill and decode processes); the kernel drops a dead holder's lock.  The file's first bytes are a
board of flags, one per prompt-side process (its slot): WAITING while it waits, HOLDING while it holds.  A
process that held the lease last lets another that is waiting go first (for at most FAIR_S), so a role whose
forwards follow each other closely cannot keep it.
Decode's turn: a prompt forward that ends hands its prompts' first tokens to decode (through the coordinator), and
decode, niced, sends each on only when it gets a core; a next prompt forward that starts at once takes both cores
for its whole length, so those first tokens waited for it (a batched forward's whole length: the slowest
TTFTs under `vllm bench serve` bursts).  So prefill counts the first tokens it hands off (HANDED, after the flags),
decode counts those it has sent (TAKEN), and a prompt-side forward starts only when decode has caught up, or
TURN_S after the last hand-off (a first token that never reaches decode, e.g. its client went away, is then
forgotten).  vLLM's one loop gets the same order: a step's new tokens go out before the next step.
A wait longer than `wait_s` computes without the lease (and says so in the log); the wait itself is observed
in `epd_compute_lease_wait_seconds{stage}`, outside the stage's compute time.  `taken_now` never waits: an
engine about to run a small forward on its event loop (compute_threads.INLINE_FORWARD_FLOPS) takes the lease
only if it is free this instant, and otherwise hands the forward to its worker thread, which may wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import Histogram

logger = logging.getLogger(__name__)

LEASE_ENV = "EPD_COMPUTE_LEASE_PATH"       # the lease file's path (set by `epd serve`)
SLOT_ENV = "EPD_COMPUTE_LEASE_SLOT"        # this process's waiting flag on the board
BOARD_BYTES = 64
HANDED, TAKEN, HANDED_AT = 64, 72, 80      # int64s after the flags: first tokens handed to decode, sent on by it, when
FOLLOWED = 88                              # nonzero once a decode follows the board (else nothing is counted)
FILE_BYTES = 96
TURN_S = 0.05                              # the longest a prompt-side forward waits for decode to send them on
STAGES = ("encode", "prefill")             # the compute stages that hold the lease (decode's steps do not)
FAIR_S = 0.05                              # how long the last holder defers to a waiter
WAITING, HOLDING = 1, 2                    # a slot's flag on the board
YIELD_BUDGET_S = 0.5                       # the most a decode step pauses for prompt-side forwards
WAIT_S = 10.0                              # the longest wait for the lease before computing without it
_EMPTY = bytes(BOARD_BYTES)
_POLL_S = (5e-5, 5e-4)                     # the waiting poll's first and longest sleep
PAUSE_S = (1e-4, 2e-3)                     # a paused decode step's first and longest sleep (fused_step.c's too)
LEASE_WAIT = Histogram("epd_compute_lease_wait_seconds", "Time a forward waited for the compute lease (encode and "
                       "prefill take turns on the cores: services/hostcpu/compute_lease.py)", ["stage"],
                       buckets=(0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


def create(path: str) -> str:
    """The lease file with an empty board (`epd serve`, before it starts the roles)."""
    with open(path, "wb") as file:
        file.write(bytes(FILE_BYTES))
    return path


class ComputeLease:
    """The lease at `path` for the process whose waiting flag is `slot` (0 .. BOARD_BYTES - 1)."""

    def __init__(self, path: str, slot: int, wait_s: float = WAIT_S) -> None:
        if not 0 <= slot < BOARD_BYTES:
            raise ValueError(f"compute lease slot {slot} is outside 0..{BOARD_BYTES - 1}")
        self.path, self.slot, self.wait_s = path, slot, wait_s
        self._fd = os.open(path, os.O_RDWR)
        self._board = mmap.mmap(self._fd, FILE_BYTES)
        self._board[slot] = 0   # a flag an earlier process in this slot left when it was killed
        self._mutex = threading.Lock()       # one holder per process (flock is per open file, not per thread)
        self._held_last = False
        self.timeouts = 0

    def _others_waiting(self) -> bool:
        board = self._board[:BOARD_BYTES]
        return any(flag == WAITING for index, flag in enumerate(board) if index != self.slot)

    def _try(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def handed_off(self, count: int) -> None:
        """A forward just ended with `count` prompts whose first tokens go on to decode (on these cores, if a decode
        follows the board: decode on another host sends them on without taking these cores)."""
        if not self._board[FOLLOWED]:
            return
        handed, taken, at = struct.unpack_from("<qqq", self._board, HANDED)
        now = time.monotonic_ns()
        base = taken if taken >= handed or now - at >= TURN_S * 1e9 else handed   # older ones not taken: forgotten
        struct.pack_into("<q", self._board, HANDED, base + count)   # TAKEN is decode's to write
        struct.pack_into("<q", self._board, HANDED_AT, now)

    def turn_pending(self) -> bool:
        """Decode has not yet sent on the first tokens handed to it less than TURN_S ago."""
        handed, taken, at = struct.unpack_from("<qqq", self._board, HANDED)
        return taken < handed and time.monotonic_ns() - at < TURN_S * 1e9

    def await_turn(self) -> None:
        pause = _POLL_S[0]
        while self.turn_pending():
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])

    @contextlib.contextmanager
    def hold(self, stage: str) -> Iterator[bool]:
        """Holds the lease for the block; yields False when it computed without it (`wait_s` passed)."""
        with self._mutex:
            began = time.monotonic()
            self.await_turn()
            got = self._acquire(began)
            LEASE_WAIT.labels(stage).observe(time.monotonic() - began)
            self._board[self.slot] = HOLDING   # decode pauses meanwhile (also when computing without the lease)
            try:
                yield got
            finally:
                self._board[self.slot] = 0     # before the unlock: a flag never outlives its holder's lock
                if got:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                self._held_last = got

    def try_hold(self) -> bool:
        """The lease if it is free now and fairness does not make this process wait (then `release()` it)."""
        if self.turn_pending() or not self._mutex.acquire(blocking=False):
            return False
        if (self._held_last and self._others_waiting()) or not self._try():
            self._mutex.release()
            return False
        self._board[self.slot] = HOLDING
        return True

    def release(self) -> None:
        self._board[self.slot] = 0
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._held_last = True
        self._mutex.release()

    def _acquire(self, began: float) -> bool:
        if not (self._held_last and self._others_waiting()) and self._try():
            return True
        self._board[self.slot] = WAITING
        try:
            pause = _POLL_S[0]
            while True:
                waited = time.monotonic() - began
                defer = self._held_last and waited < FAIR_S and self._others_waiting()
                if not defer and self._try():
                    return True
                if waited >= self.wait_s:
                    self.timeouts += 1
                    logger.warning("compute lease %s: waited %.1f s; computing without it", self.path, waited)
                    return False
                time.sleep(pause)
                pause = min(pause * 2, _POLL_S[1])
        finally:
            self._board[self.slot] = 0

    def close(self) -> None:
        self._board.close()
        os.close(self._fd)


class Follower:
    """Decode's view of the lease at `path`: whether a prompt-side forward holds or waits for it.  Never takes it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR)
        self.board = mmap.mmap(self._fd, FILE_BYTES)   # read here; its address goes to the fused step (the flags)
        self.board[FOLLOWED] = 1

    def busy(self) -> bool:
        return self.board[:BOARD_BYTES] != _EMPTY

    def sent_first_token(self) -> None:
        """A request's first token went out (decode's turn: prompt forwards wait for it).  Two decode instances on
        one board may lose a count to each other: a forward then waits TURN_S at most."""
        taken = struct.unpack_from("<q", self.board, TAKEN)[0]
        struct.pack_into("<q", self.board, TAKEN, taken + 1)

    def clear_stale(self) -> bool:
        """Flags a killed process left cleared (decode calls it once a step paused its whole budget on the board);
        True if there were any.  A HOLDING flag is set after its lock is taken and cleared before it is dropped,
        so with a shared lock of our own (no holder can exist) one left is stale.  A WAITING flag met then is
        stale too: a live waiter polls the free lock every `_POLL_S[1]` at most and would have taken it during the
        budget; a waiter killed while another held the lease left its flag, and every step after paused its
        budget on it, and the last holder's next forwards deferred to it (FAIR_S).  Were a live waiter's flag
        cleared in that instant, it only goes unseen until it holds the lease (its HOLDING flag is its own)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            stale = [index for index, flag in enumerate(self.board[:BOARD_BYTES]) if flag in (WAITING, HOLDING)]
            for index in stale:
                self.board[index] = 0
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        if stale:
            logger.warning("compute lease %s: cleared %d flag(s) a killed process left", self.path, len(stale))
        return bool(stale)

    def pause(self, deadline: float, long_running: Callable[[], bool] = lambda: False) -> float:
        """Sleeps while the board is busy (and no long prompt prefills), until `deadline` (monotonic);
        the seconds paused (the eager step, between layers; the fused step does the same in C)."""
        began = now = time.monotonic()
        pause = PAUSE_S[0]
        while now < deadline and self.busy() and not long_running():
            time.sleep(pause)
            pause = min(pause * 2, PAUSE_S[1])
            now = time.monotonic()
        return now - began


_FOLLOWER: list[Follower] = []


def follow_from_env() -> str:
    """Decode's start-up: the lease `epd serve` made, followed (EPD_COMPUTE_LEASE_PATH without a slot)."""
    path = os.environ.get(LEASE_ENV, "")
    if not path:
        return ""
    _FOLLOWER[:] = [Follower(path)]
    return f"decode steps yield to prompt-side forwards on {path} (at most {YIELD_BUDGET_S:g} s a step)"


def follower() -> Follower | None:
    return _FOLLOWER[0] if _FOLLOWER else None


_LEASE: list[ComputeLease] = []
_TAKEN = threading.local()   # .on: this thread took the lease with taken_now; its forwards' `held` is a no-op


def configure(path: str, slot: int) -> ComputeLease:
    """This process's lease (the roles' start-up); compute_metrics.compute_timer holds it around forwards."""
    lease = ComputeLease(path, slot)
    _LEASE[:] = [lease]
    return lease


def configure_from_env() -> str:
    """The lease `epd serve` set for this process (EPD_COMPUTE_LEASE_PATH and _SLOT: roles started apart may set
    them to share one), if any; a line for the start-up log."""
    path, slot = os.environ.get(LEASE_ENV, ""), os.environ.get(SLOT_ENV, "0")
    if not path:
        return ""
    configure(path, int(slot))
    return f"compute lease {path} (slot {slot})"


def handed_off(count: int) -> None:
    """Prefill: a forward ended with `count` prompts whose first tokens go on to decode (decode's turn)."""
    if _LEASE and count:
        _LEASE[0].handed_off(count)


def turn_pending() -> bool:
    """Whether a prompt-side forward should let decode send on first tokens first (ComputeLease.turn_pending)."""
    return bool(_LEASE) and _LEASE[0].turn_pending()


def sent_first_token() -> None:
    """Decode: a request's first token went out to the coordinator."""
    if _FOLLOWER:
        _FOLLOWER[0].sent_first_token()


@contextlib.contextmanager
def held(stage: str) -> Iterator[None]:
    """The process's lease around a forward (nothing where none is configured)."""
    if not _LEASE or getattr(_TAKEN, "on", False):
        yield
        return
    with _LEASE[0].hold(stage):
        yield


@contextlib.contextmanager
def taken_now(stage: str) -> Iterator[bool]:
    """Yields True holding the process's lease (or with none configured), False at once when it is not free now."""
    if not _LEASE:
        yield True
        return
    lease = _LEASE[0]
    if not lease.try_hold():
        yield False
        return
    LEASE_WAIT.labels(stage).observe(0.0)
    _TAKEN.on = True
    try:
        yield True
    finally:
        _TAKEN.on = False
        lease.release()


__all__ = ["BOARD_BYTES", "FILE_BYTES", "HOLDING", "LEASE_ENV", "SLOT_ENV", "STAGES", "TURN_S", "WAITING",
           "YIELD_BUDGET_S", "ComputeLease", "Follower", "configure", "configure_from_env", "create",
           "follow_from_env", "follower", "handed_off", "held", "sent_first_token", "taken_now", "turn_pending"]
