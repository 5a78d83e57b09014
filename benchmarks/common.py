"""What every benchmark script shares: figures with targets, percentiles, JSON and text output.

A `Figure` is one measured ratio (or value) and the target it is judged by; `print_figures`
prints the table every script ends with, and `write_json` keeps the raw numbers next to it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


RESULTS_ENV = "EPD_BENCH_RESULTS_DIR"


def results_dir(quick: bool) -> Path:
    """Full runs keep their JSON in the tree (benchmarks/results/).  Quick runs (smoke tests) write to
    $EPD_BENCH_RESULTS_DIR, else to a fresh temporary folder of this process: never to a fixed shared path,
    where two runs at once would overwrite each other."""
    if not quick:
        return RESULTS_DIR
    return Path(os.environ[RESULTS_ENV]) if os.environ.get(RESULTS_ENV) else scratch_dir("epd-bench-results-")


_SCRATCH: dict[str, Path] = {}


def scratch_dir(prefix: str) -> Path:
    """One private temporary folder per prefix and process (created on first use, announced once)."""
    if prefix not in _SCRATCH:
        _SCRATCH[prefix] = Path(tempfile.mkdtemp(prefix=prefix))
        print(f"[benchmarks] writing to {_SCRATCH[prefix]}", file=sys.stderr, flush=True)
    return _SCRATCH[prefix]


@dataclass
class Figure:
    """One figure: `value` compared with `target` by `op` ("ge", "le", "eq")."""

    name: str
    value: float | None
    target: float | None = None
    op: str = "ge"
    unit: str = "x"
    detail: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def passed(self) -> bool | None:
        if self.target is None or self.value is None or not math.isfinite(self.value):
            return None
        if self.op == "ge":
            return self.value >= self.target
        if self.op == "le":
            return self.value <= self.target
        return abs(self.value - self.target) < 1e-9

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "n/a"}[self.passed]

    def target_text(self) -> str:
        if self.target is None:
            return "-"
        sign = {"ge": ">=", "le": "<=", "eq": "="}[self.op]
        return f"{sign} {format_value(self.target, self.unit)}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def format_value(value: float | None, unit: str = "x") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if unit == "x":
        return f"{value:.2f}x" if value >= 0.01 else f"1/{1 / value:,.0f}" if value > 0 else "0x"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "count":
        return f"{value:g}"
    return f"{value:.3g} {unit}"


def print_figures(figures: Sequence[Figure], title: str, out: Any = sys.stdout) -> None:
    width = max([len(f.name) for f in figures] + [20])
    print(f"\n== {title} ==", file=out)
    print(f"{'figure':<{width}}  {'measured':>12}  {'target':>12}  verdict", file=out)
    for f in figures:
        print(f"{f.name:<{width}}  {format_value(f.value, f.unit):>12}  {f.target_text():>12}  {f.verdict}"
              + (f"  ({f.note})" if f.note else ""), file=out)


def markdown_table(figures: Iterable[Figure]) -> str:
    rows = ["| figure | measured | target | verdict | details | measured at (load avg) |", "|---|---|---|---|---|---|"]
    for f in figures:
        when = f.detail.get("measured") or {}
        at = f"{when.get('time', '-')} ({', '.join(str(x) for x in when.get('loadavg', []))})" if when else "-"
        rows.append(f"| {f.name} | {format_value(f.value, f.unit)} | {f.target_text()} | {f.verdict} | "
                    f"{f.note or '-'} | {at} |")
    return "\n".join(rows)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not denominator:
        return None
    return numerator / denominator


def machine() -> dict[str, Any]:
    """Where the figures were measured (they only mean something next to this)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "loadavg_at_start": [round(x, 2) for x in load],
                            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__,
                    torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    return info


def write_json(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n", encoding="utf-8")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Figure):
        return value.as_dict()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return repr(value)


BENCHMARKS_DOC = ROOT / "docs" / "benchmarks.md"
DOC_BLOCKS_DIR = RESULTS_DIR / "docs"   # one JSON per docs/benchmarks.md section: the page is generated from them


def replace_block(path: Path, name: str, body: str) -> None:
    """Replace the text between `<!-- name:begin -->` and `<!-- name:end -->` in a Markdown file
    (appended at the end when the markers are missing), so scripts refresh only their own figures.
    docs/benchmarks.md is generated whole from benchmarks/results/docs/*.json (scripts/gen_benchmarks_doc.py):
    its blocks are written there, with the script that wrote them, and the page rendered again."""
    if path.resolve() == BENCHMARKS_DOC.resolve():
        _save_doc_block(name, body)
        return
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    path.write_text(text, encoding="utf-8")


def script_module(frame_globals: dict[str, Any]) -> str:
    """The module a frame runs in: run with `python -m`, a script's __name__ is "__main__" and its spec names it."""
    spec = frame_globals.get("__spec__")
    return str(getattr(spec, "name", None) or frame_globals.get("__name__", ""))


def _save_doc_block(name: str, body: str) -> None:
    import inspect

    caller = next((f for f in inspect.stack()[2:] if script_module(f.frame.f_globals).startswith("benchmarks.")
                   and script_module(f.frame.f_globals) != __name__), None)
    module = caller.frame.f_globals if caller is not None else {}
    script = script_module(module) if module else ""
    title = ((module.get("__doc__") or "").strip().splitlines() or [name])[0].rstrip(".")
    write_json({"name": name, "script": script, "title": title, "written": machine()["time"], "body": body.rstrip()},
               DOC_BLOCKS_DIR / f"{name}.json")
    from benchmarks.docpage import write_page

    write_page()


def write_doc_block(name: str, command: str, figures: Sequence[Figure], extra: str = "",
                    where: dict[str, Any] | None = None) -> None:
    """Refresh one script's block of docs/benchmarks.md: its command, the machine's load (`where`: a run's own
    `machine()`, when the block is written again from its JSON), its figures."""
    where = where or machine()
    body = (f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load average "
            f"{where['loadavg_at_start']}).\n\n{markdown_table(figures)}" + (f"\n\n{extra}" if extra else ""))
    replace_block(ROOT / "docs" / "benchmarks.md", name, body)
