"""Writer and reader processes hammering one shm slot, for the cross-process seqlock test (test_shm_stress.py).

    python -m tests.services.connectors.shm_stress writer INSTANCE SECONDS
    python -m tests.services.connectors.shm_stress reader SEGMENT MODE:FENCE:READS:SECONDS ...

The writer is the real producer (ShmTensorStore.put) rewriting one key as fast
as it can (resting briefly every PAUSE_EVERY puts) until its stdin closes:
every put frees the key and reuses the same slot and the same extent, filling
the payload with the entry's generation (it checks that put i got generation
i).  A reader holds "handles" it builds from the slot header, as a consumer
holding a stale handle would, and reads:

- `raw`: the seqlock primitives the reader uses (Layout.read_begin, a copy,
  Layout.read_end), millions of times;
- `view`: the whole consumer path (ShmReader.view, a copy inside the block);
- `unchecked`: `raw` without the closing check, the control that proves the
  harness sees torn payloads when the protocol is not followed.

A read is `ok` (all words equal the generation it was read under), `torn`
(it passed the checks, yet holds other words), or `retry` (the checks saw
the entry change: the reader would report EntryMissing).  FENCE is `auto` or
`compiled` (services.connectors.shm_fence).  The reader runs its phases in
order in one process (one torch import); a phase ends after READS reads or
SECONDS, an `unchecked` one also at its first torn read; one JSON line per
phase.  The writer prints its segment, then its put count.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import torch

from services.connectors.base import EntryMissing, StoreConfig
from services.connectors.codec import TensorSpec
from services.connectors.shm import ShmTensorStore
from services.connectors.shm_fence import install
from services.connectors.shm_layout import READY, Layout
from services.connectors.shm_reader import ShmReader, ShmRef
from services.connectors.shm_segment import attach_segment

NUMEL = 8192  # 64 KiB of int64 words: a copy long enough to overlap the writer's
KEY = "k"
# The writer rests PAUSE_S after every PAUSE_EVERY puts.  A whole consumer-path read (`view`) lasts many put
# cycles, so without rests only ~0.01-3% of them succeeded, and on a busy 2-core machine none at times (a
# clean-clone run once saw 0 of 100,000): the test's "some succeed" check then failed for no fault.  The raw
# reads still overlap thousands of puts between two rests.
PAUSE_EVERY, PAUSE_S = 256, 0.0005


def writer(instance: str, seconds: float) -> dict[str, int]:
    """Rewrite the key until stdin closes (or `seconds` pass)."""
    store = ShmTensorStore(StoreConfig("shm", "kv", instance, capacity_bytes=1 << 20, ttl_s=3600))
    print(json.dumps({"segment": store.segment}), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    payload = torch.empty(NUMEL, dtype=torch.int64)
    puts, deadline = 0, time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < deadline:
        puts += 1
        payload.fill_(puts)
        handle = store.put(KEY, {"x": payload})
        if handle["generation"] != puts or handle["slot"] != 0:
            raise SystemExit(f"put {puts} got generation {handle['generation']} in slot {handle['slot']}")
        if puts % PAUSE_EVERY == 0:
            time.sleep(PAUSE_S)   # a window in which a whole `view` read can finish (else the writer never idles)
    store.close()
    return {"puts": puts}


def _raw_read(layout: Layout, mm: object, buf: np.ndarray, checked: bool) -> str:
    head = layout.read_begin(mm, 0)  # type: ignore[arg-type]
    if head.state != READY:
        return "retry"
    words = buf[head.offset: head.offset + NUMEL * 8].view(np.int64).copy()
    if checked:
        end = layout.read_end(mm, 0)  # type: ignore[arg-type]
        if end.state != READY or end.gen != head.gen:
            return "retry"
    return "torn" if (words != head.gen).any() else "ok"


def _view_read(reader: ShmReader, layout: Layout, segment: str, mm: object, out: torch.Tensor) -> str:
    head = layout.read_begin(mm, 0)  # type: ignore[arg-type]
    if head.state != READY:  # handles are only ever given out for READY entries
        return "retry"
    spec = TensorSpec("x", "int64", (NUMEL,), 0, NUMEL * 8)
    ref = ShmRef(KEY, segment, 0, head.gen, head.offset, head.length, [spec], [])
    try:
        with reader.view(ref) as views:
            out.copy_(views["x"])
    except EntryMissing:
        return "retry"
    return "torn" if bool((out != head.gen).any()) else "ok"


def reader(segment: str, mode: str, fence: str, max_reads: int, seconds: float) -> dict[str, object]:
    install(fence)
    seg = attach_segment(segment)
    layout = Layout.read_header(seg.mm)
    assert layout is not None
    counts = {"ok": 0, "torn": 0, "retry": 0}
    view_reader, out = ShmReader(False), torch.empty(NUMEL, dtype=torch.int64)
    started = time.monotonic()
    reads = 0
    while reads < max_reads and time.monotonic() < started + seconds:
        if mode == "unchecked" and counts["torn"]:
            break
        reads += 1000
        for _ in range(1000):
            if mode == "view":
                outcome = _view_read(view_reader, layout, segment, seg.mm, out)
            else:
                outcome = _raw_read(layout, seg.mm, seg.buf, checked=mode == "raw")
            counts[outcome] += 1
    view_reader.close()
    seg.close()
    return {"mode": mode, "fence": fence, **counts, "reads": sum(counts.values()),
            "seconds": round(time.monotonic() - started, 2)}


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    if argv[0] == "writer":
        print(json.dumps(writer(argv[1], float(argv[2]))), flush=True)
        return 0
    for phase in argv[2:]:
        mode, fence, reads, seconds = phase.split(":")
        print(json.dumps(reader(argv[1], mode, fence, int(reads), float(seconds))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
