"""When each stage is busy: an opt-in log of compute spans, for the pipeline-overlap plot.

With `EPD_ACTIVITY_DIR` set in a process's environment (benchmarks set it for every process
`epd serve` starts; nobody sets it in production), every `span(stage)` appends one line
`stage<TAB>start_ns<TAB>end_ns` to `<dir>/<stage>.<pid>.tsv`; times are CLOCK_MONOTONIC
(`time.monotonic_ns`), one clock for every process of the machine, so the spans of all roles
line up.  Without it `span` costs one attribute check.  `compute_timer` (the engines' forwards
and steps) records through it; render marks its own work.  `read_spans(dir)` loads them back.

Bounded: a process stops writing after `MAX_SPANS` spans (a benchmark run needs thousands).

`mark(event)` records a point event (`event<TAB>ns` in `<dir>/<pid>.marks`, one open file per
process): the path of one request through the processes (`benchmarks/request_trace.py`) is these
marks and the compute spans in time order; `read_marks(dir)` loads them back.  Off, it costs the
same one check.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV = "EPD_ACTIVITY_DIR"
MAX_SPANS = 1_000_000


class _Log:
    def __init__(self) -> None:
        self.folder = os.environ.get(ENV) or None
        self.count = 0
        self.lock = threading.Lock()
        self.out: dict[str, Any] = {}   # stage -> its file, opened once (not per span: the trace times the gaps)

    def write(self, stage: str, start: int, end: int) -> None:
        with self.lock:
            if self.count >= MAX_SPANS:
                return
            self.count += 1
            out = self.out.get(stage)
            if out is None:
                assert self.folder is not None
                out = self.out[stage] = open(Path(self.folder) / f"{stage}.{os.getpid()}.tsv", "a",  # noqa: SIM115
                                             encoding="utf-8", buffering=1)  # a line per write, as the marks
            out.write(f"{stage}\t{start}\t{end}\n")


_LOG = _Log()


class _Marks:
    def __init__(self, folder: str | None) -> None:
        self.folder = folder
        self.count = 0
        self.lock = threading.Lock()
        self.out: Any = None

    def write(self, event: str, at: int) -> None:
        with self.lock:
            if self.count >= MAX_SPANS:
                return
            self.count += 1
            if self.out is None:
                assert self.folder is not None
                self.out = open(Path(self.folder) / f"{os.getpid()}.marks", "a", encoding="utf-8",  # noqa: SIM115
                                buffering=1)  # one line per write: a killed process loses nothing
            self.out.write(f"{event}\t{at}\n")


_MARKS = _Marks(_LOG.folder)


def mark(event: str) -> None:
    """Record that `event` happened now (when the log is on)."""
    if _MARKS.folder is not None:
        _MARKS.write(event, time.monotonic_ns())


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


def read_marks(folder: str | Path) -> list[tuple[int, str, int]]:
    """(ns, event, pid) of every mark any process wrote into `folder`, in time order."""
    marks = []
    for path in Path(folder).glob("*.marks"):
        pid = int(path.stem)
        for line in path.read_text(encoding="utf-8").splitlines():
            event, at = line.split("\t")
            marks.append((int(at), event, pid))
    return sorted(marks)
