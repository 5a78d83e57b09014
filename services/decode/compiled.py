"""A compiled decode step: torch.compile (Inductor's CPU C++ backend) over the paged forward, one graph
per batch-size bucket.

Why: an eager step is ~40 torch ops per layer (RMSNorm alone is six), each a Python dispatch; with
SmolLM2's 30 layers that is ~1,200 dispatches per token.  Compiled, everything between the GEMMs and
the attention fuses into a few C++ loops per layer (norm, rope, silu·mul, residual adds), and the
GEMMs (`epd::packed_linear`, services/models/prepack.py) and the KV write + paged attention
(`epd::paged_attention`, services/decode/paged_forward.py) stay opaque custom ops that run exactly the
code the eager step runs.

Buckets: graphs are static in the batch size (1, 2, 4, ... up to the engine's rows, and the row count
itself).  A step of `count` rows runs the smallest compiled bucket >= count; the runner fills the
rows past `count` with padding that writes and reads only the pool's scratch block (never handed to a
request, services/decode/block_pool.py), and drops their logits.  A count whose bucket is not
compiled runs eagerly.

Choice (`--decode-step`, `choose_step`): "eager" compiles nothing; "compiled" compiles every bucket;
"auto" compiles buckets in order within `--decode-compile-budget-s`, times eager against compiled
on each (interleaved, best of a few rounds) and keeps compiled only where it is at least
`MIN_SPEEDUP` faster.  Every compiled bucket is first checked against the eager step (logits within
`MAX_REL_DIFF`).  A compile that fails, of any kind, leaves the step eager with one log line; a cold
compile still running when the budget ends is left to finish in a daemon thread (it fills the cache
for the next start, its result is not used).  Compiled artifacts persist in Inductor's FX graph and
AOT caches under `<EPD_CACHE_DIR or ~/.cache/epd>/inductor` (unless TORCHINDUCTOR_CACHE_DIR is set),
so a second start skips code generation and the C++ compiler.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.hostcpu import compute_threads

logger = logging.getLogger(__name__)

STEP_MODES = ("auto", "eager", "compiled")
MIN_SPEEDUP = 1.03       # auto keeps a compiled bucket only if eager / compiled >= this
MAX_REL_DIFF = 1e-4      # compiled logits must agree with the eager step's this closely
_ROUNDS = 5
_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}


def step_buckets(max_rows: int, asked: Sequence[int] | None = None) -> tuple[int, ...]:
    """`asked` (sorted, each in 1..max_rows), or by default 1, 2, 4, ... below max_rows, then max_rows."""
    if asked:
        chosen = tuple(sorted(set(asked)))
        if chosen[0] < 1 or chosen[-1] > max_rows:
            raise ValueError(f"step buckets must be in 1..{max_rows} (the engine's rows), got {chosen}")
        return chosen
    found, size = [], 1
    while size < max_rows:
        found.append(size)
        size *= 2
    return (*found, max_rows)


def cache_dir() -> Path:
    root = os.environ.get("EPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "epd")
    return Path(root) / "inductor"


@dataclass
class BucketResult:
    compile_s: float | None = None        # wall time of the first (compiling) call
    eager_ms: float | None = None         # best step time, eager (auto only)
    compiled_ms: float | None = None      # best step time, compiled (auto only)
    max_rel_diff: float | None = None     # compiled vs eager logits
    mode: str = "eager"                   # what runs at this bucket
    note: str = ""


@dataclass
class StepReport:
    """What `choose_step` did: per bucket what runs, its timings, and why."""

    asked: str
    mode: str = "eager"                   # "compiled" when any bucket runs compiled, else "eager"
    reason: str = ""
    buckets: dict[int, BucketResult] = field(default_factory=dict)

    @property
    def compiled_buckets(self) -> tuple[int, ...]:
        return tuple(b for b, r in self.buckets.items() if r.mode == "compiled")

    def line(self) -> str:
        parts = []
        for bucket, r in self.buckets.items():
            timing = (f" eager {r.eager_ms:.2f} ms / compiled {r.compiled_ms:.2f} ms"
                      if r.eager_ms is not None and r.compiled_ms is not None else "")
            built = f" compile {r.compile_s:.1f} s" if r.compile_s is not None else ""
            parts.append(f"{bucket}: {r.mode}{timing}{built}{' (' + r.note + ')' if r.note else ''}")
        detail = f" [{'; '.join(parts)}]" if parts else ""
        return f"decode step {self.mode} (mode {self.asked}{': ' + self.reason if self.reason else ''}){detail}"


Inputs = tuple[torch.Tensor, ...]   # token_ids, positions, write_blocks, write_offsets, tables, lens
Scope = Callable[[], AbstractContextManager[Any]]   # makes the custom ops' objects current (PagedDecoder.active)


class CompiledStep:
    """The compiled forward and the buckets it may run; `bucket_for(count)` is None where eager runs."""

    def __init__(self, forward: Callable[..., torch.Tensor], buckets: tuple[int, ...] = (),
                 scope: Scope = nullcontext) -> None:
        self.forward, self.buckets, self.scope = forward, buckets, scope
        self._failed = False

    @property
    def enabled(self) -> bool:
        return bool(self.buckets) and not self._failed

    def bucket_for(self, count: int) -> int | None:
        if self._failed:
            return None
        return next((b for b in self.buckets if b >= count), None)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        """The compiled step's logits, or None (and compiled off for good) if it raised or would recompile."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"), self.scope():
                return self.forward(*inputs)
        except Exception as exc:
            self._failed = True
            logger.error("compiled decode step failed (%s: %s); running eager from now on", type(exc).__name__,
                         str(exc).splitlines()[0] if str(exc) else "")
            return None


# Rows of the runner's int64 step buffer [4, max_rows]: token ids, positions, write blocks, write offsets.
IDS, POS, BLOCK, OFFSET = range(4)


def step_inputs(step64: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, rows: int, device: torch.device
                ) -> Inputs:
    """The forward's inputs for the first `rows` rows of the step buffers (views on CPU)."""
    step = step64[:, :rows].to(device)
    return step[IDS], step[POS], step[BLOCK], step[OFFSET], tables[:rows].to(device), lens[:rows].to(device)


def pad_inputs(bucket: int, max_rows: int, max_blocks: int, scratch_block: int, device: torch.device) -> Inputs:
    """A step of `bucket` padding rows (token 0 at position 0, K/V to and from the scratch block only),
    in buffers of their own laid out as the runner's (the same strides and offsets the graph is built for)."""
    step64 = torch.zeros((4, max_rows), dtype=torch.int64)
    step64[BLOCK] = scratch_block
    tables = torch.zeros((max_rows, max_blocks), dtype=torch.int32)
    tables[:, 0] = scratch_block
    return step_inputs(step64, tables, torch.ones(max_rows, dtype=torch.int32), bucket, device)


def _inductor_default_dir() -> str:
    """Where Inductor caches when TORCHINDUCTOR_CACHE_DIR is unset (as its cache_dir_utils computes it)."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def configure_cache() -> str:
    """Point Inductor's cache at `cache_dir()` unless the user chose one; returns the folder in use.
    Inductor writes its default into TORCHINDUCTOR_CACHE_DIR the first time it is imported, so that
    value counts as unset (it must be replaced before the first compile, not merely set if missing)."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == _inductor_default_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _configure() -> None:
    configure_cache()
    import torch._dynamo
    import torch._inductor.config

    # kernels compile in this process, one after another: no pool of worker processes (each imports torch and
    # stays alive after the compile) beside a role on a small machine; on 2 cores the pool was no faster
    torch._inductor.config.compile_threads = 1
    # one cache entry per bucket (and per engine in a process that builds several): never fall back silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)


def _run_bounded(fn: Callable[[], Any], timeout: float | None) -> tuple[bool, BaseException | None]:
    """Run fn in a daemon thread; (finished, error).  Past `timeout` the thread is left to finish alone."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            compute_threads.enter()   # Inductor sizes its OpenMP regions by this thread's count
            with torch.inference_mode():
                fn()
            outcome.append(None)
        except BaseException as exc:  # reported to the caller, who falls back to eager
            outcome.append(exc)

    thread = threading.Thread(target=target, name="decode-compile", daemon=True)
    thread.start()
    thread.join(timeout)
    return (bool(outcome), outcome[0] if outcome else None)


def choose_step(forward: Callable[..., torch.Tensor], mode: str, buckets: tuple[int, ...],
                make_inputs: Callable[[int], Inputs], budget_s: float = 120.0, scope: Scope = nullcontext
                ) -> tuple[CompiledStep, StepReport]:
    """Compile (and for "auto" time) the step per bucket; the returned step runs compiled where chosen.
    `scope()` is entered around every call of the compiled graph."""
    if mode not in STEP_MODES:
        raise ValueError(f"unknown decode step mode {mode!r}; supported: {', '.join(STEP_MODES)}")
    report = StepReport(asked=mode)
    if mode == "eager":
        report.reason = "asked"
        return CompiledStep(forward), report
    _configure()
    graph = torch.compile(forward, fullgraph=True, dynamic=False, options=_INDUCTOR_OPTIONS)

    def compiled(*inputs: torch.Tensor) -> torch.Tensor:
        with scope():
            return graph(*inputs)

    deadline = time.monotonic() + budget_s if mode == "auto" else None
    for bucket in buckets:
        result = report.buckets.setdefault(bucket, BucketResult())
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            result.note = "budget spent"
            continue
        if not _compile_bucket(compiled, forward, make_inputs(bucket), result, left, mode == "auto"):
            if result.note.startswith("compile failed"):
                report.reason = result.note
                break
    chosen = report.compiled_buckets
    report.mode = "compiled" if chosen else "eager"
    if not report.reason:
        report.reason = _summary(report, budget_s)
    return CompiledStep(graph, chosen, scope), report


def _compile_bucket(compiled: Callable[..., torch.Tensor], forward: Callable[..., torch.Tensor], inputs: Inputs,
                    result: BucketResult, timeout: float | None, timed: bool) -> bool:
    started = time.monotonic()
    finished, error = _run_bounded(lambda: compiled(*inputs), timeout)
    if not finished:
        result.note = f"still compiling after {time.monotonic() - started:.0f} s (budget); eager"
        logger.warning("decode step: bucket %d %s", len(inputs[0]), result.note)
        return False
    result.compile_s = time.monotonic() - started
    if error is not None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        result.note = f"compile failed: {type(error).__name__}: {first[:200]}"
        logger.error("decode step: %s; running eager", result.note)
        return False
    with torch.inference_mode():
        want, got = forward(*inputs), compiled(*inputs)
        result.max_rel_diff = float((want - got).abs().max() / want.abs().max().clamp_min(1e-30))
        if not result.max_rel_diff <= MAX_REL_DIFF:
            result.note = f"compiled logits differ by {result.max_rel_diff:.1e} relative"
            return False
        if timed:
            result.eager_ms, result.compiled_ms = _time_both(forward, compiled, inputs)
            if result.eager_ms < MIN_SPEEDUP * result.compiled_ms:
                result.note = "eager as fast"
                return True
    result.mode = "compiled"
    return True


def _time_both(forward: Callable[..., torch.Tensor], compiled: Callable[..., torch.Tensor], inputs: Inputs
               ) -> tuple[float, float]:
    best = {"eager": float("inf"), "compiled": float("inf")}
    for _ in range(_ROUNDS):   # interleaved: the machine's noise falls on both
        for name, fn in (("eager", forward), ("compiled", compiled)):
            start = time.perf_counter()
            fn(*inputs)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best["eager"], best["compiled"]


def _summary(report: StepReport, budget_s: float) -> str:
    chosen, results = report.compiled_buckets, report.buckets.values()
    if report.asked == "compiled":
        return "asked" if chosen else "nothing compiled"
    if any(r.note.startswith(("still compiling", "budget")) for r in results):
        return f"compile budget {budget_s:.0f} s spent" + ("" if chosen else "; eager")
    return "measured"
