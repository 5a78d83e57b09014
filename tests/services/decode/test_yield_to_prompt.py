"""Decode steps yield to prompt-side forwards (services/hostcpu/compute_lease.py, fused_step.c's epd_fused_yield_to).

A real process holds the real lease file (as encode's or prefill's forward does): a fused step and an eager step
started meanwhile pause at a layer's start until it lets go, then give exactly the logits of a step that never
paused.  The negative controls: the same step with no lease followed, or while a long prompt prefills, does not
wait.  A holder killed mid-forward leaves its flag; a step then pauses only its budget, and the flag is cleared
(not while a live holder stands behind it)."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from services.decode.fused import FusedStep
from services.decode.paged_forward import PagedDecoder
from services.hostcpu import compute_lease, role_cpu
from tests.services.decode.conftest import StepBatch

ROOT = Path(__file__).resolve().parents[3]
_HOLDER = textwrap.dedent("""
    import sys, time
    from services.hostcpu import compute_lease
    path, hold_s = sys.argv[1], float(sys.argv[2])
    compute_lease.configure(path, 0)
    with compute_lease.held("prefill"):
        print("held", flush=True)
        time.sleep(hold_s)             # the forward (sleeping, so the step under test has the cores)
    print("released", flush=True)
""")
_WAITER = textwrap.dedent("""
    import sys
    from services.hostcpu import compute_lease
    compute_lease.configure(sys.argv[1], 1)
    with compute_lease.held("encode"):   # waits behind the holder: killed meanwhile
        pass
""")


def _hold(path: str, hold_s: float) -> subprocess.Popen:
    """A process holding the lease for `hold_s`; returns once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, path, str(hold_s)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def lease(tmp_path, monkeypatch):
    """A lease file this process follows as decode does; no long-prompt board unless a test opens one."""
    path = compute_lease.create(str(tmp_path / "lease"))
    monkeypatch.setenv(compute_lease.LEASE_ENV, path)
    monkeypatch.setattr(role_cpu, "_LONG", {})
    assert compute_lease.follow_from_env()
    yield path
    compute_lease._FOLLOWER.clear()


def _run(tiny, prefilled, fused: bool) -> tuple[torch.Tensor, float, PagedDecoder]:
    """One decode step over a fresh pool (the prompts' KV loaded): (logits, seconds, its decoder)."""
    batch = StepBatch(tiny, prefilled)
    began = time.monotonic()
    with torch.inference_mode():
        out = FusedStep(batch.decoder, 4)(*batch.inputs) if fused else batch.decoder.forward(*batch.inputs)
    return out, time.monotonic() - began, batch.decoder


def _reference(tiny, prefilled, fused: bool) -> torch.Tensor:
    follower = compute_lease._FOLLOWER[:]
    compute_lease._FOLLOWER.clear()
    try:
        return _run(tiny, prefilled, fused)[0]
    finally:
        compute_lease._FOLLOWER[:] = follower


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_a_step_pauses_while_a_prompt_forward_holds_the_lease_and_gives_the_same_logits(tiny, prefilled, lease,
                                                                                        monkeypatch, fused):
    monkeypatch.setattr(compute_lease, "YIELD_BUDGET_S", 10.0)   # the holder's release ends the pause, not the budget
    want = _reference(tiny, prefilled, fused)
    holder = _hold(lease, 0.8)
    try:
        board = compute_lease.follower().board
        assert board[0] == compute_lease.HOLDING
        got, took, _ = _run(tiny, prefilled, fused)
    finally:
        holder.wait(timeout=30)
    assert torch.equal(got, want)                       # paused at a layer's start, then went on where it was
    assert 0.4 <= took < 5.0, took                      # about the holder's remaining 0.8 s
    assert board[0] == 0                                # the holder cleared its flag before letting go
    again, quick, _ = _run(tiny, prefilled, fused)      # nobody holds it now: no pause
    assert quick < 0.3 and torch.equal(again, want)


def _sleeps() -> int:
    """This process's voluntary context switches so far (every thread's): a paused thread's wake-ups."""
    total = 0
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:   # a thread that ended meanwhile
            continue
        total += int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_a_paused_step_sleeps_longer_and_longer_not_waking_through_the_forward(tiny, prefilled, lease, monkeypatch,
                                                                               fused):
    """A pause sleeps 100 us, then twice as long each time up to 2 ms (compute_lease.PAUSE_S): each wake-up of a
    decode thread takes a core from the prompt forward's team, and a fixed 100 us woke each thread 10,000 times a
    second (with it this test counted ~4,300 for the eager step, against ~400 now)."""
    monkeypatch.setattr(compute_lease, "YIELD_BUDGET_S", 10.0)
    _run(tiny, prefilled, fused)          # warm: the first step's one-off work is not counted
    holder = _hold(lease, 0.8)
    try:
        before = _sleeps()
        _, took, _ = _run(tiny, prefilled, fused)
        woke = _sleeps() - before
    finally:
        holder.wait(timeout=30)
    threads = 4 if fused else 1
    assert took >= 0.4, took                            # it paused through the holder's forward
    assert woke < threads * took / 1e-3 + 200, (woke, took)   # ~1 wake-up per 2 ms a thread, not 10 per ms


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_negative_controls_no_lease_followed_or_a_long_prompt_prefilling_do_not_wait(tiny, prefilled, lease,
                                                                                     tmp_path, fused):
    holder = _hold(lease, 1.5)
    try:
        follower = compute_lease._FOLLOWER[:]
        compute_lease._FOLLOWER.clear()
        try:
            _, took, _ = _run(tiny, prefilled, fused)           # this decode follows no lease
        finally:
            compute_lease._FOLLOWER[:] = follower
        assert took < 0.4, took
        longs = tmp_path / "long"
        longs.write_bytes(bytes(role_cpu.LONG_BOARD_BYTES))
        with open(longs, "r+b") as file:
            board = mmap.mmap(file.fileno(), role_cpu.LONG_BOARD_BYTES)
        board[0] = 1                                            # prefill runs a chunked prompt: decode goes first
        role_cpu._LONG["map"] = board
        _, took, _ = _run(tiny, prefilled, fused)
        assert took < 0.4, took
    finally:
        holder.wait(timeout=30)


def test_a_killed_holders_flag_costs_a_step_its_budget_and_is_cleared(tiny, prefilled, lease, monkeypatch):
    monkeypatch.setattr(compute_lease, "YIELD_BUDGET_S", 0.25)
    holder = _hold(lease, 60)
    follower = compute_lease.follower()
    assert follower.clear_stale() is False                     # a live holder stands behind its flag
    holder.kill()
    holder.wait(timeout=30)
    assert follower.board[0] == compute_lease.HOLDING          # SIGKILL: its flag stayed
    _, took, _ = _run(tiny, prefilled, fused=True)
    assert 0.25 <= took < 2.0, took                            # the budget, not forever
    _, took, eager = _run(tiny, prefilled, fused=False)
    assert 0.25 <= took < 2.0, took
    assert eager.yielded_s >= 0.25
    assert follower.clear_stale() is True and not follower.busy()
    _, took, _ = _run(tiny, prefilled, fused=True)
    assert took < 0.2, took
    # a new process in that slot clears what its predecessor left
    follower.board[0] = compute_lease.HOLDING
    compute_lease.ComputeLease(lease, 0).close()
    assert follower.board[0] == 0


def test_a_waiter_killed_while_another_held_leaves_a_flag_that_is_cleared(tiny, prefilled, lease, monkeypatch):
    # An encode killed while it waited behind prefill's forward (as in the pool's fault tests) left WAITING on the
    # board for good: every decode step after paused its whole budget (0.5 s a token) and the lease's last holder
    # deferred to it at each forward. Once the lease is free, decode clears it like a dead holder's flag.
    monkeypatch.setattr(compute_lease, "YIELD_BUDGET_S", 0.25)
    holder = _hold(lease, 1.0)
    waiter = subprocess.Popen([sys.executable, "-c", _WAITER, lease], cwd=ROOT)
    follower = compute_lease.follower()
    try:
        deadline = time.monotonic() + 20
        while follower.board[1] != compute_lease.WAITING:
            assert time.monotonic() < deadline, "the waiter never waited"
            time.sleep(0.01)
        assert follower.clear_stale() is False                 # the holder's lock: nothing is judged
        waiter.kill()
        waiter.wait(timeout=30)
    finally:
        waiter.kill()
        holder.wait(timeout=30)
    assert follower.board[:2] == bytes([0, compute_lease.WAITING])   # the holder let go; the dead waiter's flag stays
    _, took, _ = _run(tiny, prefilled, fused=True)
    assert 0.25 <= took < 2.0, took                            # a step pauses its budget on it
    assert follower.clear_stale() is True and not follower.busy()
    _, took, _ = _run(tiny, prefilled, fused=True)
    assert took < 0.2, took
