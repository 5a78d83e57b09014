"""shm across real processes: handles travel as JSON on argv/stdout."""

from __future__ import annotations

import json
import os
import signal

import pytest

from services.connectors import EntryMissing, sweep_stale_segments
from tests.services.connectors.helpers import digest, read_json_line, sample_tensors, start_child

# Loads the parent's entry, puts one of its own, and keeps its segment until told to exit (exit unlinks it).
CHILD_BOTH_WAYS = """
store = create_store(StoreConfig("shm", "kv", sys.argv[2], capacity_bytes=1 << 20))
print(json.dumps({"digest": digest(store.get(json.loads(sys.argv[1])))}), flush=True)
print(json.dumps(store.put("k", sample_tensors(7))), flush=True)
sys.stdin.readline()
"""

CHILD_ORPHAN = """
store = create_store(StoreConfig("shm", "kv", sys.argv[1], capacity_bytes=1 << 20))
print(json.dumps({"segment": store.segment}), flush=True)
time.sleep(60)
"""


def test_handles_work_both_ways_until_producer_exits(make_store, instance):
    store = make_store("shm", purpose="kv")
    tensors = sample_tensors(3)
    child = start_child(CHILD_BOTH_WAYS, json.dumps(store.put("mine", tensors)), instance + "c")
    try:
        assert read_json_line(child)["digest"] == digest(tensors)
        theirs = read_json_line(child)
        assert digest(store.get(theirs)) == digest(sample_tensors(7))
        with store.view(theirs) as views:
            assert digest(views) == digest(sample_tensors(7))
        child.stdin.write("exit\n")
        child.stdin.close()
        assert child.wait(timeout=30) == 0
        assert not os.path.exists(f"/dev/shm/{theirs['segment']}")  # the producer's exit unlinked it
        with pytest.raises(EntryMissing, match="gone"):
            store.get(theirs)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
            sweep_stale_segments()


def test_sweep_removes_segment_of_killed_owner(make_store, instance):
    live = make_store("shm", suffix="live")
    child = start_child(CHILD_ORPHAN, instance)
    try:
        segment = read_json_line(child)["segment"]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert os.path.exists(f"/dev/shm/{segment}")  # SIGKILL gave it no chance to clean up
    removed = sweep_stale_segments()
    assert segment in removed and not os.path.exists(f"/dev/shm/{segment}")
    assert live.segment not in removed and os.path.exists(f"/dev/shm/{live.segment}")
