"""The compute lease (services/hostcpu/compute_lease.py): encode's and prefill's forwards take turns on the cores.

Real processes share a real lease file: their held intervals never overlap, the one that just held it lets a
waiting one go first, a dead holder's lease is free at once, and a wait past its deadline computes without it.
The negative control runs the same processes without the lease and sees their intervals overlap.  Decode's turn:
a forward waits for decode to send on the first tokens prefill just handed it (TURN_S at most)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from services.config import ConfigError, EpdConfig
from services.hostcpu import compute_lease
from services.runtime.launch import Child, compute_lease_env

_WORKER = textwrap.dedent("""
    import sys, time
    from services.hostcpu import compute_lease
    path, slot, rounds, hold_s, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    if path != "-":
        compute_lease.configure(path, slot)
    spans = []
    for _ in range(rounds):
        with compute_lease.held("prefill"):
            began = time.monotonic()
            while time.monotonic() - began < hold_s:   # busy, as a forward is
                pass
            spans.append((began, time.monotonic()))
    with open(out, "w") as f:
        f.write("\\n".join(f"{a!r} {b!r}" for a, b in spans))
""")


def _run_pair(tmp_path: Path, path: str, rounds: int = 12, hold_s: float = 0.02) -> list[list[tuple[float, float]]]:
    procs, outs = [], []
    for slot in (0, 1):
        out = tmp_path / f"spans{slot}.txt"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, path, str(slot), str(rounds), str(hold_s),
                                       str(out)], cwd=Path(__file__).resolve().parents[3]))
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    return [[tuple(map(float, line.split())) for line in out.read_text().splitlines()] for out in outs]  # type: ignore[misc]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def test_two_processes_take_turns_and_neither_keeps_the_lease(tmp_path):
    path = compute_lease.create(str(tmp_path / "lease"))
    first, second = _run_pair(tmp_path, path)
    assert len(first) == len(second) == 12
    assert _overlap(first, second) == 0.0
    # fairness: while both ran, the turns alternated (a loop that re-takes the lease at once did not keep it)
    both = sorted([(a, 0) for a, _ in first] + [(a, 1) for a, _ in second])
    start, end = max(first[0][0], second[0][0]), min(first[-1][1], second[-1][1])
    during = [who for at, who in both if start <= at <= end]
    switches = sum(1 for x, y in zip(during, during[1:], strict=False) if x != y)
    assert switches >= len(during) // 2, during


def test_without_the_lease_the_same_processes_overlap(tmp_path):
    first, second = _run_pair(tmp_path, "-", rounds=12, hold_s=0.02)
    assert _overlap(first, second) > 0.0          # the negative control: the test above can fail


def test_a_dead_holders_lease_is_free_and_a_long_wait_computes_without_it(tmp_path):
    path = compute_lease.create(str(tmp_path / "lease"))
    holder = subprocess.Popen([sys.executable, "-c", _WORKER, path, "0", "1", "30", str(tmp_path / "x")],
                              cwd=Path(__file__).resolve().parents[3])
    lease = compute_lease.ComputeLease(path, 1, wait_s=0.3)
    try:
        deadline = time.monotonic() + 20
        while not _held_elsewhere(path):             # until the holder has it
            assert time.monotonic() < deadline, "the holder never took the lease"
            time.sleep(0.01)
        began = time.monotonic()
        with lease.hold("encode") as got:
            assert got is False                      # 0.3 s passed: it computes without the lease
        assert 0.3 <= time.monotonic() - began < 5 and lease.timeouts == 1
        holder.kill()
        holder.wait(timeout=10)
        began = time.monotonic()
        with lease.hold("encode") as got:
            assert got is True                       # the kernel dropped the dead holder's lock
        assert time.monotonic() - began < 0.1
    finally:
        holder.kill()
        lease.close()


def _held_elsewhere(path: str) -> bool:
    import fcntl

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_epd_serve_gives_encode_and_prefill_one_lease_and_their_own_slots_and_decode_its_path():
    children = [Child(role, f"i_{role}{n}", 0, 0) for role, n in
                (("render", 0), ("encode", 0), ("prefill", 0), ("prefill", 1), ("decode", 0))]
    config = EpdConfig.of(instance_id="leasetest")
    env = compute_lease_env(config, children)
    try:
        assert set(env) == {"i_encode0", "i_prefill0", "i_prefill1", "i_decode0"}
        assert {e[compute_lease.LEASE_ENV] for e in env.values()} == {"/dev/shm/epd-lease-leasetest"}
        assert sorted(e[compute_lease.SLOT_ENV] for e in env.values() if compute_lease.SLOT_ENV in e) == \
            ["0", "1", "2"]
        assert compute_lease.SLOT_ENV not in env["i_decode0"]   # decode follows the lease, never takes it
        assert os.path.getsize("/dev/shm/epd-lease-leasetest") == compute_lease.FILE_BYTES
    finally:
        os.unlink("/dev/shm/epd-lease-leasetest")
    assert compute_lease_env(config.with_(compute_lease="off"), children) == {}
    text_only = [c for c in children if c.role != "encode" and c.instance_id != "i_prefill1"]
    try:   # one prompt role and a decode: decode still yields to prefill's forwards
        assert set(compute_lease_env(config, text_only)) == {"i_prefill0", "i_decode0"}
    finally:
        os.unlink("/dev/shm/epd-lease-leasetest")
    alone = [c for c in text_only if c.role != "decode"]   # nobody to share the cores with: none
    assert compute_lease_env(config, alone) == {}
    with pytest.raises(ConfigError, match="compute_lease must be one of auto, off"):
        EpdConfig.of(compute_lease="on")


def _counts(path: str) -> tuple[int, int]:
    with open(path, "rb") as file:
        board = file.read()
    return struct.unpack_from("<q", board, compute_lease.HANDED)[0], struct.unpack_from("<q", board,
                                                                                          compute_lease.TAKEN)[0]


def test_a_prompt_forward_waits_for_decode_to_send_the_first_tokens_handed_to_it(tmp_path, monkeypatch):
    """Decode's turn: after a hand-off of two first tokens, the lease is not taken (try_hold) or waited for
    (hold) until decode has sent both on; one decode never sends (its client left) is forgotten after TURN_S."""
    path = compute_lease.create(str(tmp_path / "lease"))
    lease = compute_lease.ComputeLease(path, 0)
    lease.handed_off(2)
    assert _counts(path) == (0, 0) and not lease.turn_pending()   # no decode follows: none to wait for
    decode = compute_lease.Follower(path)
    try:
        monkeypatch.setattr(compute_lease, "TURN_S", 5.0)
        lease.handed_off(2)
        assert _counts(path) == (2, 0) and lease.turn_pending() and not lease.try_hold()
        sender = threading.Timer(0.3, lambda: (decode.sent_first_token(), decode.sent_first_token()))
        began = time.monotonic()
        sender.start()
        with lease.hold("prefill") as got:
            waited = time.monotonic() - began
        sender.join()
        assert got and 0.29 <= waited < 3 and _counts(path) == (2, 2) and not lease.turn_pending()
        monkeypatch.setattr(compute_lease, "TURN_S", 0.2)
        lease.handed_off(1)                       # never sent on
        began = time.monotonic()
        with lease.hold("prefill"):
            waited = time.monotonic() - began
        assert 0.19 <= waited < 2                 # TURN_S at most
        lease.handed_off(1)                       # the lost one is forgotten: one send ends this turn
        assert _counts(path) == (3, 2) and lease.turn_pending()
        decode.sent_first_token()
        assert not lease.turn_pending() and lease.try_hold()
        lease.release()
    finally:
        lease.close()
