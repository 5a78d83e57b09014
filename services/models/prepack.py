"""Swapped linear layers: the model's matmuls on kernels with the weights laid out once at load.

Why: `F.linear` on CPU goes to MKL sgemm, which repacks the weight on every call; for a decode
step that is the whole cost of the LM head (151936 x 1024 fp32 = 622 MB read, then packed
again).  Two kernels keep the weight in their own layout instead:
- "prepacked": oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, multiplied by
  `torch.ops.mkldnn._linear_pointwise`), what vLLM's CPU backend does too; best for many rows
  (prefill, vision).
- "panel": services/models/panel_linear.py, a C kernel over 16-row panels that streams the
  weights once per step; best for the few rows of a decode step.

Who calls what: a role process, right after loading its model part, calls
`prepack_language(lm, mode, rows)` (prefill, decode: `rows` are the batch sizes it will see) or
`prepack_vision(vision, mode)` (encode).  mode "auto" times `F.linear` against every kernel that
applies here on the model's own weights (every distinct layer shape at those rows, interleaved,
best of a few rounds, bounded) and swaps to the fastest when it is at least 1.05x faster than
`F.linear` and its outputs agree to 1e-4 relative.  Each shape is timed over up to `_LAYERS_PER_SHAPE`
of the model's layers of that shape in turn, as a forward reads them: one weight timed again and again
stays in the core's cache and flatters `F.linear`, which repacks it on every call (on the medium
model's 150-row MLP GEMMs, 2.67 ms hot vs 3.04 ms cycling, against oneDNN's 2.74 ms).
The LM head is decided on its own, at `head_rows`: it runs on the few rows that finish a prompt (or
one per decode row), where a kernel that streams the weights wins, while a prefill's decoder stack
runs on hundreds of rows, where oneDNN wins; one sum over both would let the head's 622 MB decide the stack's kernel.
"prepacked" and "panel" swap both without timing; "default" leaves the model alone.  The returned
`LinearReport` (the stack's, with the head's as `.head`) says what was chosen and why; roles log it
and export it in /metrics.

Memory: each swapped `nn.Linear` holds only its kernel's copy of the weight, so the original fp32
tensor is freed (tests check with a weakref) — except a tied LM head, whose weight the input
embedding still reads: then the swapped copy is extra, and `LinearReport.extra_bytes` says how
much.  Only float32 weights on CPU are swapped.  Compiled graphs call swapped layers through a
custom op (services/models/swapped.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from services.models import kernel_choices, panel_linear
from services.models.packed_linear import (
    MIN_SPEEDUP,
    PackedLinear,
    _compare,
    _geomean,
    bf16_packable,
    can_pack,
    tolerance,
)
from services.models.swapped import SwappedLinear

if TYPE_CHECKING:
    from services.models.base import LanguageModel, VisionModel

logger = logging.getLogger(__name__)

MODES = ("auto", "panel", "prepacked", "default")
KERNELS = ("panel", "prepacked")   # what a swap can pick (auto: the fastest that applies)
_TIME_BUDGET_S = 20.0         # auto mode stops timing (and keeps what it has) after this
_LAYERS_PER_SHAPE = 4         # distinct layers of a shape each timing cycles over (module docstring)


def _kernel_applies(kernel: str, dtype: torch.dtype = torch.float32, weight_dtype: torch.dtype | None = None) -> bool:
    """`kernel` runs layers of `dtype` here, keeping their weights in `weight_dtype` (None: `dtype`)."""
    if kernel == "panel":
        return (dtype == torch.float32 and weight_dtype in (None, *panel_linear.WEIGHT_DTYPES)
                and panel_linear.available(weight_dtype or dtype))
    if (weight_dtype or dtype) == torch.bfloat16 and not bf16_packable():
        return False
    return torch.backends.mkldnn.is_available()


def make_swap(kernel: str, weight_dtype: torch.dtype | None = None) -> Callable[[nn.Linear], SwappedLinear]:
    """The constructor of `kernel`'s layer, keeping weights in `weight_dtype` (None: the layer's own)."""
    if weight_dtype is None:
        return SWAP[kernel]
    if kernel == "panel":
        return lambda linear: panel_linear.PanelLinear(linear, weight_dtype)
    return lambda linear: PackedLinear(linear, weight_dtype=weight_dtype)


SWAP: dict[str, Callable[[nn.Linear], SwappedLinear]] = {"prepacked": PackedLinear, "panel": panel_linear.PanelLinear}
__all__ = ["MODES", "KERNELS", "PackedLinear", "SwappedLinear", "LinearReport", "prepack_language", "prepack_vision",
           "export"]


@dataclass
class LinearReport:
    """What `prepack_*` did: the kernel in use, the measured speed-up and the bytes it cost."""

    kernel: str                       # "panel" | "prepacked" | "default"
    mode: str                         # what was asked
    reason: str = ""
    speedup: float | None = None      # time(F.linear) / time(chosen kernel): geometric mean over the timed
    #                                   batch sizes of the ratio of times summed over the shapes
    max_rel_diff: float | None = None
    num_swapped: int = 0
    num_fused: int = 0                # MLPs and patch embeddings swapped for fused ones (fused_mlp.py)
    fused_speedup: float | None = None  # auto: the gated MLPs' timing as a unit (fused_mlp.fuse_mlps)
    extra_bytes: int = 0              # swapped copies kept beside a weight something else still reads
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    speedups: dict[str, float] = field(default_factory=dict)   # every timed kernel's, by name
    head: LinearReport | None = None  # a language model's LM head, decided on its own (prepack_language)
    weights: str = ""                 # "bfloat16" where a float32 model's swapped weights are kept in bf16

    def line(self) -> str:
        speed = f", {self.speedup:.2f}x" if self.speedup is not None else ""
        others = "".join(f"; {k} {v:.2f}x" for k, v in self.speedups.items() if k != self.kernel)
        head = ""
        if self.head is not None:
            head_speed = f", {self.head.speedup:.2f}x" if self.head.speedup is not None else ""
            head = f"; lm_head {self.head.kernel}{head_speed}"
        fused = f", {self.num_fused} fused" if self.num_fused else ""
        if self.fused_speedup is not None:
            fused += f" (MLP {self.fused_speedup:.2f}x)"
        weights = f"{self.weights} weights, " if self.weights else ""
        return (f"linear kernel {self.kernel} ({weights}mode {self.mode}{speed}{others}; {self.num_swapped} layers "
                f"swapped{fused}, {self.extra_bytes / 2**20:.0f} MiB extra{head})"
                f"{': ' + self.reason if self.reason else ''}")


def export(report: LinearReport, part: str) -> None:
    """/metrics: `epd_linear_kernel_info{part, kernel, mode}` 1 and the measured speed-up; a language
    model's LM head as part "lm_head"."""
    from prometheus_client import Gauge

    global _INFO, _SPEEDUP
    if _INFO is None:
        _INFO = Gauge("epd_linear_kernel_info", "Matmul kernel chosen at start-up (1 = in use)",
                      ["part", "kernel", "mode"])
        _SPEEDUP = Gauge("epd_linear_kernel_speedup", "Start-up timing: F.linear time / chosen kernel's time",
                         ["part"])
    _INFO.labels(part, report.kernel, report.mode).set(1)
    if report.speedup is not None and _SPEEDUP is not None:
        _SPEEDUP.labels(part).set(report.speedup)
    if report.head is not None:
        export(report.head, "lm_head")


_INFO: Any = None
_SPEEDUP: Any = None


def prepack_language(lm: LanguageModel, mode: str = "auto", rows: tuple[int, ...] = (1, 16, 256),
                     head_rows: tuple[int, ...] = (1, 16), serial_rows: int = 0,
                     stack_mode: str | None = None, fuse: bool = False,
                     weight_dtype: torch.dtype | None = None, head_mode: str | None = None) -> LinearReport:
    """Swap the decoder stack's and the LM head's linears when `mode` says so; auto decides the two
    apart, timing the stack at `rows` and the head at `head_rows` (the batch sizes each sees).
    `num_swapped` and `extra_bytes` of the returned report count both; `.head` is the head's.
    Batch sizes up to `serial_rows` are timed on one thread, as decode runs them (--decode-serial-rows):
    on a busy box two threads' barriers make every kernel but single-threaded F.linear look slow.
    `stack_mode`, when given, decides the stack instead of `mode` (decode's fused step needs panels there).
    `fuse`: a prepacked stack's MLPs run as fused_mlp.FusedGatedMLP (prefill; decode's small batches run
    them on panels or inside the fused step).  `weight_dtype` bfloat16 keeps a float32 model's swapped
    weights in bfloat16 (decode's --dtype bfloat16: half the bytes a step reads, float32 arithmetic); then
    every swap is timed against F.linear at the bfloat16 tolerance, "default" refused.  `head_mode` decides the head."""
    if weight_dtype is not None and (stack_mode or mode) == "default":
        raise ValueError("bfloat16 weights over a float32 model need a swapped kernel, not --linear-kernel default")
    head = lm.lm_head
    tied = _tied_weights(lm.model, head)
    fused = None
    if fuse:
        from services.models.fused_mlp import fuse_mlps

        fused = fuse_mlps(lm.model, stack_mode or mode, rows)
    layers = _linears(lm.model)
    report = _decide(stack_mode or mode, _by_shape(layers, rows), serial_rows, weight_dtype)
    if report.kernel in KERNELS:
        report.num_swapped = _swap_all(layers, make_swap(report.kernel, weight_dtype))
        report.weights = "bfloat16" if weight_dtype == torch.bfloat16 else ""
    if fused is not None:
        report.num_fused, report.fused_speedup = fused.count, fused.speedup
        report.num_swapped += 3 * fused.gated
    if can_pack(head):
        report.head = _decide(head_mode or mode, [("lm_head", [head], head_rows)], serial_rows, weight_dtype)
        if report.head.kernel in KERNELS:
            lm.lm_head = make_swap(report.head.kernel, weight_dtype)(head)
            report.head.num_swapped = 1
            report.head.extra_bytes = _bytes(head.weight) if tied else 0
            report.num_swapped += 1
            report.extra_bytes += report.head.extra_bytes
    logger.info(report.line())
    return report


def prepack_vision(vision: VisionModel, mode: str = "auto", rows: tuple[int, ...] = (256, 1024),
                   fuse: bool = True) -> LinearReport:
    """The same for a vision tower (`vision.tower`), timed at patch counts an image gives.  Unless mode is
    "default" or `fuse` is False, its patch embedding runs as a GEMM and its MLPs fused first (fused_mlp.py)."""
    from services.models.fused_mlp import fuse_mlps, gemm_patch_embeds

    tower = getattr(vision, "tower", None)
    if not isinstance(tower, nn.Module):
        return LinearReport("default", mode, reason="no tower module")
    fused = fuse_mlps(tower, mode if fuse else "default", rows)
    embeds = gemm_patch_embeds(tower) if fuse and mode != "default" else 0
    layers = _linears(tower)
    report = _decide(mode, _by_shape(layers, rows))
    if report.kernel in KERNELS:
        report.num_swapped = _swap_all(layers, SWAP[report.kernel])
    report.num_fused, report.fused_speedup = fused.count + embeds, fused.speedup
    report.num_swapped += 3 * fused.gated
    logger.info("vision " + report.line())
    return report


def _linears(root: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every swappable linear under `root`."""
    return [(parent, name, cast(nn.Linear, child)) for parent in root.modules()
            for name, child in parent.named_children() if can_pack(child)]


def _by_shape(layers: list[tuple[nn.Module, str, nn.Linear]], rows: tuple[int, ...]
              ) -> list[tuple[str, list[nn.Linear], tuple[int, ...]]]:
    shapes: dict[tuple[int, int], list[nn.Linear]] = {}
    for _, _, linear in layers:
        same = shapes.setdefault((linear.out_features, linear.in_features), [])
        if len(same) < _LAYERS_PER_SHAPE:
            same.append(linear)
    return [(f"{o}x{i}", linears, rows) for (o, i), linears in shapes.items()]


def _swap_all(layers: list[tuple[nn.Module, str, nn.Linear]], swap: Callable[[nn.Linear], SwappedLinear]) -> int:
    for parent, name, linear in layers:
        setattr(parent, name, swap(linear))
    return len(layers)


def _tied_weights(model: nn.Module, head: Any) -> bool:
    weight = getattr(head, "weight", None)
    return weight is not None and any(p is weight for p in model.parameters())


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _decide(mode: str, timed: list[tuple[str, list[nn.Linear], tuple[int, ...]]], serial_rows: int = 0,
            weight_dtype: torch.dtype | None = None) -> LinearReport:
    if mode not in MODES:
        raise ValueError(f"unknown linear kernel mode {mode!r}; supported: {', '.join(MODES)}")
    if mode == "default" or not timed:
        return LinearReport("default", mode, reason="asked" if mode == "default" else "nothing packable")
    if mode in KERNELS:
        if not _kernel_applies(mode):
            detail = panel_linear.unavailable_reason() if mode == "panel" else "oneDNN is not available"
            raise ValueError(f"linear kernel {mode!r} is not available here: {detail}")
        if not _kernel_applies(mode, _dtype(timed), weight_dtype):
            raise ValueError(f"linear kernel {mode!r} does not run {_dtype(timed)} layers"
                             f"{f' over {weight_dtype} weights' if weight_dtype else ''} here")
        return LinearReport(mode, mode, reason="asked")
    kernels = [k for k in KERNELS if _kernel_applies(k, _dtype(timed), weight_dtype)]
    if weight_dtype is not None and not kernels:
        raise ValueError(f"no linear kernel keeps {weight_dtype} weights here")
    what = {"shapes": [[name, list(linears[0].weight.shape), list(rows), len(linears), linears[0].bias is not None]
                       for name, linears, rows in timed],
            "dtype": str(_dtype(timed)), "kernels": kernels, "serial_rows": serial_rows, "weights": str(weight_dtype)}
    fields = {f.name for f in dataclasses.fields(LinearReport)} - {"head"}
    decision, timed_at = kernel_choices.decided(
        "linear", what, lambda: _fields(_measure(timed, kernels, serial_rows, weight_dtype), fields),
        valid=lambda kept: set(kept) == fields and kept["kernel"] in ("default", *kernels))
    report = LinearReport(**decision)
    if timed_at:
        report.reason += f" at {timed_at}, kept (services/models/kernel_choices.py)"
    return report


def _fields(report: LinearReport, names: set[str]) -> dict[str, Any]:
    return {name: getattr(report, name) for name in names}


def _dtype(timed: list[tuple[str, list[nn.Linear], tuple[int, ...]]]) -> torch.dtype:
    return timed[0][1][0].weight.dtype


def _measure(timed: list[tuple[str, list[nn.Linear], tuple[int, ...]]], kernels: list[str],
             serial_rows: int = 0, weight_dtype: torch.dtype | None = None) -> LinearReport:
    from services.hostcpu import compute_threads

    # on the threads the engine will run them with, in a thread that then ends (under kernel_choices' timing lock)
    return compute_threads.run_in_fresh_thread(lambda: _measure_alone(timed, kernels, serial_rows, weight_dtype))


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@torch.inference_mode()
def _measure_alone(timed: list[tuple[str, list[nn.Linear], tuple[int, ...]]], kernels: list[str],
                   serial_rows: int, weight_dtype: torch.dtype | None = None) -> LinearReport:
    started = time.monotonic()
    # time per kernel and batch size, summed over the shapes: a step's time at that batch size
    totals: dict[str, dict[int, float]] = {k: {} for k in ["default", *kernels]}
    worst = dict.fromkeys(kernels, 0.0)
    timings: dict[str, dict[str, float]] = {}
    for name, linears, rows in timed:
        if time.monotonic() - started > _TIME_BUDGET_S:
            break
        candidates: dict[str, list[nn.Module]] = {"default": list(linears),
                      **{k: [make_swap(k, weight_dtype)(linear) for linear in linears] for k in kernels}}
        for count in rows:
            x = torch.randn(count, linears[0].in_features, dtype=linears[0].weight.dtype)
            with _threads(1 if count <= serial_rows else None):
                best, diffs = _compare(candidates, x)
            timings[f"{name}@{count}"] = {f"{k}_ms": v for k, v in best.items()}
            for kernel, ms in best.items():
                totals[kernel][count] = totals[kernel].get(count, 0.0) + ms
            for kernel, diff in diffs.items():
                worst[kernel] = max(worst[kernel], diff)
        del candidates
    if not totals["default"]:
        return LinearReport("default", "auto", reason="nothing timed", timings_ms=timings)
    speedups = {k: _geomean([totals["default"][n] / totals[k][n] for n in totals["default"]]) for k in kernels}
    limit = tolerance(weight_dtype or _dtype(timed))
    agreeing = {k: v for k, v in speedups.items() if worst[k] <= limit}
    chosen = max(agreeing, key=lambda k: agreeing[k], default=None)
    reason = "measured" + "".join(f"; {k} outputs differ by {worst[k]:.1e} relative" for k in kernels
                                  if worst[k] > limit)
    # with weight_dtype, F.linear would keep float32 weights: any agreeing kernel wins, however fast
    if chosen is None or (weight_dtype is None and agreeing[chosen] < MIN_SPEEDUP):
        return LinearReport("default", "auto", reason=reason, speedup=1.0, timings_ms=timings, speedups=speedups,
                            max_rel_diff=max(worst.values(), default=None))
    return LinearReport(chosen, "auto", reason=reason, speedup=speedups[chosen], max_rel_diff=worst[chosen],
                        timings_ms=timings, speedups=speedups)
