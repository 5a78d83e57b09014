"""`epd serve` runs five separate OS processes and leaves nothing behind after SIGTERM."""

from __future__ import annotations

import os
import struct
import time
import uuid

from services.hostcpu import compute_lease
from tests.support.cluster import start_cluster


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _turn_counts(instance_id: str) -> tuple[int, int]:
    """The first tokens prefill handed to decode and those decode sent on (decode's turn, compute_lease.py)."""
    with open(f"/dev/shm/epd-lease-{instance_id}", "rb") as file:
        return struct.unpack_from("<qq", file.read(), compute_lease.HANDED)


def test_serve_runs_five_processes_and_cleans_up(demo_model_path):
    instance_id = "proc" + uuid.uuid4().hex[:6]  # shm names carry it: concurrent suites must not share one
    cluster = start_cluster("--instance-id", instance_id, "--ec-capacity-mb", "16", "--kv-capacity-mb", "16")
    try:
        children = _children(cluster.process.pid)
        roles = sorted(_cmdline(pid).split()[-1] for pid in children)
        assert roles == ["coordinator", "decode", "encode", "prefill", "render"]
        assert len(set(children)) == 5
        segments = [n for n in os.listdir("/dev/shm") if instance_id in n]
        assert segments, "the shm connectors should own segments while serving"
        with cluster.client() as client:
            assert client.get("/health").status_code == 200
            # decode's turn across the real processes: each first token prefill hands off, decode counts as sent
            handed, sent = _turn_counts(instance_id)
            assert handed == sent
            for max_tokens, stream in ((4, True), (3, False), (1, False)):   # max_tokens 1 goes through decode too
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}
                reply = client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
            assert _turn_counts(instance_id) == (handed + 3, sent + 3)
        # render blocks torch on purpose: transformers' "PyTorch was not found" advice is not printed
        assert not [line for line in cluster.output if "PyTorch was not found" in line]
    finally:
        assert cluster.stop() == 0
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)]
    assert [n for n in os.listdir("/dev/shm") if instance_id in n] == []
