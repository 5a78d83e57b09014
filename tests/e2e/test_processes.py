"""`epd serve` runs five separate OS processes and leaves nothing behind after SIGTERM."""

from __future__ import annotations

import os
import time
import uuid

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
        # render blocks torch on purpose: transformers' "PyTorch was not found" advice is not printed
        assert not [line for line in cluster.output if "PyTorch was not found" in line]
    finally:
        assert cluster.stop() == 0
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)]
    assert [n for n in os.listdir("/dev/shm") if instance_id in n] == []
