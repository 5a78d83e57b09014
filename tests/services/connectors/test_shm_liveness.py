"""Consumers unmap the pools of producers that are gone (real producer processes; the consumer is this one).

A producer that is SIGKILLed leaves its segment behind with no lock holder; one
that exits (or is restarted and swept) unlinks it.  Either way the consumer's
cached attachment must go within a bounded time (the reader checks every
LIVENESS_INTERVAL_S), or the tmpfs pages stay pinned in this process.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from services.connectors.shm_reader import LIVENESS_INTERVAL_S
from tests.services.connectors.helpers import read_json_line, start_child

BOUND_S = 3 * LIVENESS_INTERVAL_S + 2.0  # two checks, plus scheduling slack on a loaded machine

# Its own namespace: `epd serve` and role start-ups on this machine sweep dead owners' segments of the "epd"
# namespace, which would unlink this one before the consumer could show that it does.
PRODUCER = """
store = create_store(StoreConfig("shm", "ec", sys.argv[1], capacity_bytes=4 << 20, namespace="epdliveness"))
print(json.dumps(store.put("img", {"x": torch.arange(1000, dtype=torch.float32)})), flush=True)
sys.stdin.readline()
"""


def _mapped(segment: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"/dev/shm/{segment}" in line for line in maps)


def _wait_unmapped(segment: str) -> float:
    started = time.monotonic()
    while _mapped(segment):
        assert time.monotonic() - started < BOUND_S, f"{segment} still mapped after {BOUND_S} s"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def producer(instance):
    child = start_child("import torch\n" + PRODUCER, instance + "p")
    handle = read_json_line(child)
    yield child, handle
    if child.poll() is None:
        child.kill()
        child.wait(timeout=10)


def test_killed_producer_is_unmapped_and_unlinked_once_no_view_uses_it(make_store, producer):
    child, handle = producer
    consumer = make_store("shm", suffix="c", preallocate=False)
    with consumer.view(handle) as views:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        time.sleep(2.5 * LIVENESS_INTERVAL_S)
        assert _mapped(handle["segment"])  # in use by this view: kept, still readable
        assert torch.equal(views["x"], torch.arange(1000, dtype=torch.float32))
    del views  # the last zero-copy tensors: the mapping can go now
    assert os.path.exists(f"/dev/shm/{handle['segment']}")  # nobody cleaned up after the kill...
    _wait_unmapped(handle["segment"])
    assert not os.path.exists(f"/dev/shm/{handle['segment']}")  # ...its lock was free: the consumer unlinked it


def test_live_producer_stays_mapped_and_an_exited_one_is_unmapped(make_store, producer):
    child, handle = producer
    consumer = make_store("shm", suffix="c", preallocate=False)
    consumer.get(handle)
    time.sleep(2.5 * LIVENESS_INTERVAL_S)
    assert _mapped(handle["segment"])  # the producer lives: nothing to drop
    child.stdin.write("exit\n")
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    _wait_unmapped(handle["segment"])
