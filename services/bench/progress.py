"""A progress display on stderr: tqdm when installed, else one rewritten line."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, ok: bool) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    def update(self, ok: bool) -> None:
        pass

    def close(self) -> None:
        pass


class LineProgress:
    """Rewrites one stderr line at most 4 times a second."""

    def __init__(self, total: int | None, desc: str) -> None:
        self.total, self.desc = total, desc
        self.done = self.failed = 0
        self._shown = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if now - self._shown >= 0.25 or self.done == self.total:
            self._shown = now
            self._show()

    def _show(self) -> None:
        total = f"/{self.total}" if self.total else ""
        sys.stderr.write(f"\r{self.desc}: {self.done}{total} done, {self.failed} failed")
        sys.stderr.flush()

    def close(self) -> None:
        self._show()
        sys.stderr.write("\n")


class TqdmProgress:
    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.failed = 0

    def update(self, ok: bool) -> None:
        if not ok:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def make_progress(enabled: bool, total: int | None, desc: str) -> Progress:
    if not enabled:
        return NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return LineProgress(total, desc)
    return TqdmProgress(tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True))
