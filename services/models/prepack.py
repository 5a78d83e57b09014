"""Prepacked linear layers: oneDNN GEMMs over weights reordered once at load time.

Why: `F.linear` on CPU goes to MKL sgemm, which repacks the weight on every call; for a
decode step that is the whole cost of the LM head (151936 x 1024 fp32 = 622 MB read, then
packed again).  oneDNN can keep the weight in its own blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) and multiply against it directly
(`torch.ops.mkldnn._linear_pointwise`), which is what vLLM's CPU backend does too.

Who calls what: a role process, right after loading its model part, calls
`prepack_language(lm, mode)` (prefill, decode) or `prepack_vision(vision, mode)` (encode).
mode "auto" times `F.linear` against the packed GEMM on the model's own weights (the LM
head and every distinct layer shape, rows a decode step and a prefill see, interleaved,
best of a few rounds, bounded) and swaps only when packed is faster and its outputs agree
to 1e-4 relative; "prepacked" swaps without timing; "default" leaves the model alone.  The
returned `LinearReport` says what was chosen and why; roles log it and export it in /metrics.

Memory: each swapped `nn.Linear` is replaced by a `PackedLinear` that holds only the packed
weight, so the original fp32 tensor is freed (tests check with a weakref) — except a tied
LM head, whose weight the input embedding still reads: then the packed copy is extra, and
`LinearReport.extra_bytes` says how much.  Only float32 weights on CPU are packed.

torch.compile cannot trace the packed weight (an opaque oneDNN tensor has no storage to fake),
so under compilation `PackedLinear` calls the custom op `epd::packed_linear(x, index,
out_features)` instead: `index` is the layer's place in the list of packed linears that the
caller makes current with `packed_scope(linears)` around each call of the compiled graph (so
the graph names no object of this process and Inductor's cache serves any load of the same
model), the op's fake implementation gives the output shape, and the compiled graph calls the
same oneDNN GEMM between its fused kernels (services/decode/compiled.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from services.models.base import LanguageModel, VisionModel

logger = logging.getLogger(__name__)

MODES = ("auto", "prepacked", "default")
MIN_SPEEDUP = 1.05            # below this the swap is not worth a second code path
MAX_REL_DIFF = 1e-4           # packed outputs must agree with F.linear this closely
_BATCH_HINT = 16              # oneDNN picks its blocking for this many rows (decode batches)
_ROUNDS = 3
_TIME_BUDGET_S = 20.0         # auto mode stops timing (and keeps what it has) after this


class PackedLinear(nn.Module):
    """`nn.Linear` over a oneDNN-packed weight.  `weight` is the opaque packed tensor: its dtype,
    device and shape read as the original's (transformers reads `fc2.weight.dtype`), its values
    only through `forward`."""

    def __init__(self, linear: nn.Linear, batch_hint: int = _BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = pack_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.scope_index: int | None = None   # its place in the list given to `packed_scope`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():   # the graph calls the GEMM by index (module docstring)
            if self.scope_index is None:
                raise RuntimeError("a PackedLinear is compiled without an index: number it with number_packed()")
            return torch.ops.epd.packed_linear(x, self.scope_index, self.out_features)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def number_packed(modules: Sequence[nn.Module]) -> list[PackedLinear]:
    """The PackedLinears among `modules` (in order), each told its index in the returned list."""
    packed = [m for m in modules if isinstance(m, PackedLinear)]
    for index, module in enumerate(packed):
        module.scope_index = index
    return packed


_SCOPE = threading.local()


@contextmanager
def packed_scope(linears: list[PackedLinear]) -> Iterator[None]:
    """Make `linears` the table `epd::packed_linear` indexes into, in this thread."""
    previous = getattr(_SCOPE, "linears", None)
    _SCOPE.linears = linears
    try:
        yield
    finally:
        _SCOPE.linears = previous


_OPS = torch.library.Library("epd", "FRAGMENT")
_OPS.define("packed_linear(Tensor x, int index, int out_features) -> Tensor")


def _packed_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    linears = getattr(_SCOPE, "linears", None)
    if linears is None:
        raise RuntimeError("epd::packed_linear called outside packed_scope()")
    return linears[index].run(x)


def _packed_linear_fake(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_OPS.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("epd::packed_linear", _packed_linear_fake, lib=_OPS)


def pack_weight(weight: torch.Tensor, batch_hint: int = _BATCH_HINT) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def can_pack(linear: nn.Module) -> bool:
    weight = getattr(linear, "weight", None)
    return (type(linear) is nn.Linear and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
            and weight.device.type == "cpu" and torch.backends.mkldnn.is_available())


@dataclass
class LinearReport:
    """What `prepack_*` did: the kernel in use, the measured speed-up and the bytes it cost."""

    kernel: str                       # "prepacked" | "default"
    mode: str                         # what was asked
    reason: str = ""
    speedup: float | None = None      # time(F.linear) / time(packed), summed over the timed shapes
    max_rel_diff: float | None = None
    num_swapped: int = 0
    extra_bytes: int = 0              # packed copies kept beside a weight something else still reads
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def line(self) -> str:
        speed = f", {self.speedup:.2f}x" if self.speedup is not None else ""
        return (f"linear kernel {self.kernel} (mode {self.mode}{speed}; {self.num_swapped} layers swapped, "
                f"{self.extra_bytes / 2**20:.0f} MiB extra){': ' + self.reason if self.reason else ''}")


def export(report: LinearReport, part: str) -> None:
    """/metrics: `epd_linear_kernel_info{part, kernel, mode}` 1 and the measured speed-up."""
    from prometheus_client import Gauge

    global _INFO, _SPEEDUP
    if _INFO is None:
        _INFO = Gauge("epd_linear_kernel_info", "Matmul kernel chosen at start-up (1 = in use)",
                      ["part", "kernel", "mode"])
        _SPEEDUP = Gauge("epd_linear_kernel_speedup", "Start-up timing: F.linear time / prepacked time",
                         ["part"])
    _INFO.labels(part, report.kernel, report.mode).set(1)
    if report.speedup is not None and _SPEEDUP is not None:
        _SPEEDUP.labels(part).set(report.speedup)


_INFO: Any = None
_SPEEDUP: Any = None


def prepack_language(lm: LanguageModel, mode: str = "auto", rows: tuple[int, ...] = (1, 16, 256)) -> LinearReport:
    """Swap the decoder stack's and the LM head's linears for packed ones when `mode` says so."""
    head = lm.lm_head
    tied = _tied_weights(lm.model, head)
    layers = _linears(lm.model)
    timed = ([("lm_head", head, (1, 16))] if can_pack(head) else []) + _by_shape(layers, rows)
    report = _decide(mode, timed)
    if report.kernel == "prepacked":
        report.num_swapped = _swap_all(lm.model, layers)
        if can_pack(head):
            lm.lm_head = PackedLinear(head)
            report.num_swapped += 1
            report.extra_bytes = _bytes(head.weight) if tied else 0
    logger.info(report.line())
    return report


def prepack_vision(vision: VisionModel, mode: str = "auto", rows: tuple[int, ...] = (256, 1024)) -> LinearReport:
    """The same for a vision tower (`vision.tower`), timed at patch counts an image gives."""
    tower = getattr(vision, "tower", None)
    if not isinstance(tower, nn.Module):
        return LinearReport("default", mode, reason="no tower module")
    layers = _linears(tower)
    report = _decide(mode, _by_shape(layers, rows))
    if report.kernel == "prepacked":
        report.num_swapped = _swap_all(tower, layers)
    logger.info("vision " + report.line())
    return report


def _linears(root: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every packable linear under `root`."""
    return [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()
            if can_pack(child)]


def _by_shape(layers: list[tuple[nn.Module, str, nn.Linear]], rows: tuple[int, ...]
              ) -> list[tuple[str, nn.Linear, tuple[int, ...]]]:
    shapes: dict[tuple[int, int], nn.Linear] = {}
    for _, _, linear in layers:
        shapes.setdefault((linear.out_features, linear.in_features), linear)
    return [(f"{o}x{i}", linear, rows) for (o, i), linear in shapes.items()]


def _swap_all(root: nn.Module, layers: list[tuple[nn.Module, str, nn.Linear]]) -> int:
    for parent, name, linear in layers:
        setattr(parent, name, PackedLinear(linear))
    return len(layers)


def _tied_weights(model: nn.Module, head: Any) -> bool:
    weight = getattr(head, "weight", None)
    return weight is not None and any(p is weight for p in model.parameters())


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _decide(mode: str, timed: list[tuple[str, nn.Linear, tuple[int, ...]]]) -> LinearReport:
    if mode not in MODES:
        raise ValueError(f"unknown linear kernel mode {mode!r}; supported: {', '.join(MODES)}")
    if mode == "default" or not timed:
        return LinearReport("default", mode, reason="asked" if mode == "default" else "nothing packable")
    if mode == "prepacked":
        return LinearReport("prepacked", mode, reason="asked")
    return _measure(timed)


@torch.inference_mode()
def _measure(timed: list[tuple[str, nn.Linear, tuple[int, ...]]]) -> LinearReport:
    started, plain_total, packed_total, worst = time.monotonic(), 0.0, 0.0, 0.0
    timings: dict[str, dict[str, float]] = {}
    for name, linear, rows in timed:
        if time.monotonic() - started > _TIME_BUDGET_S:
            break
        packed = PackedLinear(linear)
        for count in rows:
            x = torch.randn(count, linear.in_features)
            plain_ms, packed_ms, diff = _compare(linear, packed, x)
            timings[f"{name}@{count}"] = {"default_ms": plain_ms, "prepacked_ms": packed_ms}
            plain_total, packed_total, worst = plain_total + plain_ms, packed_total + packed_ms, max(worst, diff)
        del packed
    speedup = plain_total / packed_total if packed_total else None
    kernel = "prepacked" if speedup and speedup >= MIN_SPEEDUP and worst <= MAX_REL_DIFF else "default"
    reason = "measured" if worst <= MAX_REL_DIFF else f"outputs differ by {worst:.1e} relative"
    return LinearReport(kernel, "auto", reason=reason, speedup=speedup, max_rel_diff=worst, timings_ms=timings)


def _compare(linear: nn.Linear, packed: PackedLinear, x: torch.Tensor) -> tuple[float, float, float]:
    reference, candidate = linear(x), packed(x)
    diff = float((reference - candidate).abs().max() / reference.abs().max().clamp_min(1e-30))
    best = {"plain": float("inf"), "packed": float("inf")}
    for _ in range(_ROUNDS):   # interleaved: machine noise falls on both
        for key, fn in (("plain", linear), ("packed", packed)):
            start = time.perf_counter()
            fn(x)
            best[key] = min(best[key], (time.perf_counter() - start) * 1e3)
    return best["plain"], best["packed"], diff
