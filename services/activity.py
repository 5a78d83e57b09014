"""When each stage is busy: an opt-in log of compute spans, for the pipeline-overlap plot.

With `EPD_ACTIVITY_DIR` set in a process's environment (benchmarks set it for every process
`epd serve` starts; nobody sets it in production), every `span(stage)` appends one line
`stage<TAB>start_ns<TAB>end_ns` to `<dir>/<stage>.<pid>.tsv`; times are CLOCK_MONOTONIC
(`time.monotonic_ns`), one clock for every process of the machine, so the spans of all roles
line up.  Without it `span` costs one attribute check.  `compute_timer` (the engines' forwards
and steps) records through it; render marks its own work.  `read_spans(dir)` loads them back.

Bounded: a process stops writing after `MAX_SPANS` spans (a benchmark run needs thousands).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "EPD_ACTIVITY_DIR"
MAX_SPANS = 1_000_000


class _Log:
    def __init__(self) -> None:
        self.folder = os.environ.get(ENV) or None
        self.count = 0
        self.lock = threading.Lock()

    def write(self, stage: str, start: int, end: int) -> None:
        with self.lock:
            if self.count >= MAX_SPANS:
                return
            self.count += 1
            assert self.folder is not None
            path = Path(self.folder) / f"{stage}.{os.getpid()}.tsv"
            with open(path, "a", encoding="utf-8") as out:
                out.write(f"{stage}\t{start}\t{end}\n")


_LOG = _Log()


@contextmanager
def span(stage: str) -> Iterator[None]:
    """Record the block's wall time as busy time of `stage` (when the log is on)."""
    if _LOG.folder is None:
        yield
        return
    start = time.monotonic_ns()
    try:
        yield
    finally:
        _LOG.write(stage, start, time.monotonic_ns())


def read_spans(folder: str | Path) -> dict[str, list[tuple[int, int]]]:
    """stage -> [(start_ns, end_ns)] sorted, from every process that wrote into `folder`."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for path in sorted(Path(folder).glob("*.tsv")):
        for line in path.read_text(encoding="utf-8").splitlines():
            stage, start, end = line.split("\t")
            spans.setdefault(stage, []).append((int(start), int(end)))
    return {stage: sorted(items) for stage, items in spans.items()}
