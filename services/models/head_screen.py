"""Greedy tokens of a float32 LM head from a quarter or half of its bytes: a screen, then float32 on a few columns.

A decode step's LM head reads the whole [vocab, hidden] weight (622 MB for a 151,936 x 1,024 float32
head) to pick one token per greedy row.  `HeadScreen` keeps a second, smaller copy of the head, runs that
screen instead of the head, and decides the token exactly.  Its kernel is, by what the CPU has:
- "int8" (AVX512-VNNI): an int8 copy with a scale per column, a quarter of the bytes, and a bound per
  column (services/models/head_int8.py, whose docstring holds its proof);
- "pairs" (AVX512-BF16): a bfloat16 copy, vdpbf16ps over x rounded to bfloat16 too
  (services/kernels/panel.c), and the bound below;
- "widened": float32 x over the bfloat16 panels widened exactly in registers, and the bound below.

- For every column j, |screen_j - logit_j| <= eps(x), from the weights' norms (`weight_bounds`, once at
  start-up; float32 norms, their own rounding covered by a factor 1.001), u = 2^-24, gamma_K = K u / (1 - K u):
  - widened: eps = ||x|| max_j (||W_j - bf16(W_j)|| + gamma_K (||bf16(W_j)|| + ||W_j||));
  - pairs: the same with ||bf16(x)|| <= (1 + 2^-8) ||x|| on the screen's side, plus ||x - bf16(x)|| max_j
    ||bf16(W_j)|| for rounding x, plus a term for flushed denormals;
  (Cauchy-Schwarz on the rounding, and the standard bound of a float32 sum of K products in any order,
  once for each side.)
- The float32 argmax j* has logit_j* >= logit_js for the screen's own argmax js, so
  screen_j* >= max(screen) - 2 eps.  Every column that reaches that threshold is a candidate; only
  the candidates' float32 logits are computed, each exactly as the head's panel kernel computes it
  (one in-order fused multiply-add chain: the same bits), and the first largest wins, as the full
  row's argmax picks the first index among ties.

So the token is the float32 head's token, by proof rather than by tolerance; tests check it against
the full head on random and adversarial rows (exact ties, near-ties below bfloat16's resolution), and
that a bound of zero would pick wrong tokens there.  A row whose screen holds a NaN or an infinity,
or with more than `cap` candidates, answers -1 and the caller runs the full head for it.

Applies to rows that are plain greedy (no logprobs, penalties or min_tokens suppression: they need
every logit) and to heads swapped to float32 panels without a bias (services/models/prepack.py).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from services.models import head_int8, panel_linear
from services.models.panel_linear import NR, PanelLinear

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
KERNELS = ("auto", "int8", "pairs", "widened")
CAP = 64              # candidates per row before the row falls back to the full head (bfloat16 kernels)
# auto leaves narrower heads alone: there the screen's fixed costs (its [R, vocab] pass, the bound) outweigh the
# halved weight bytes (tiny demo, 151936x64: 0.89x at 1 row, 1.07x at 4; SmolLM2's 576 and the medium model's
# 1024 are faster at every row count: docs/benchmarks.md "Decode: the LM head screen")
AUTO_MIN_HIDDEN = 256
# auto's int8 kernel is judged on the model's real rows: a model whose hidden states carry a few huge components
# (SmolLM2: 15.7 against a median of 0.46) quantizes x coarsely, and the int8 bound then leaves hundreds or thousands
# of columns a row; after its first JUDGE_ROWS rows auto moves to the bfloat16 pairs for good if int8 sent more than
# JUDGE_FULL of them to the full head or left more than JUDGE_CANDIDATES float32 logits per screened row
JUDGE_ROWS, JUDGE_FULL, JUDGE_CANDIDATES = 64, 0.1, 256
_U = 2.0 ** -24       # float32 unit roundoff
_CHUNK_BYTES = 1 << 20   # the bound's float32 temporaries per chunk of panels (head_int8._CHUNK_BYTES says why)


@dataclass
class ScreenReport:
    """What start-up decided (the decode log line and /metrics)."""
    mode: str
    enabled: bool
    reason: str
    extra_bytes: int = 0
    bound: float = 0.0
    kernel: str = ""

    def line(self) -> str:
        if not self.enabled:
            return f"lm head screen off ({self.reason})"
        if self.kernel == "int8":
            return (f"lm head screen on: int8 panels, a scale and a bound per column (+{self.extra_bytes / 2**20:.0f} "
                    f"MiB), float32 on the candidates ({self.reason})")
        return (f"lm head screen on: bfloat16 panels, {self.kernel} (+{self.extra_bytes / 2**20:.0f} MiB), float32 "
                f"on the candidates within 2 x {self.bound:.3g} x ||x|| of the top ({self.reason})")


@dataclass
class Bounds:
    """Per-weight constants of the screen's bound (see the module docstring), computed once at start-up.

    widened: |s - l| <= widened ||x|| when the screen multiplies float32 x by bfloat16 weights (in-order sums);
    pairs: |s - l| <= pairs ||x|| + w_max ||x - bf16(x)|| + tiny when x is rounded to bfloat16 too and the
    products are summed in any order (vdpbf16ps)."""
    widened: float
    pairs: float
    w_max: float


def weight_bounds(panels: torch.Tensor, screen: torch.Tensor) -> Bounds:
    """The bound's constants from the panels as they are ([Q, K, 16], float32 and its bfloat16 rounding).

    W - bf16(W) is exact in float32; the float32 norms carry a relative error below K u (< 1e-3 for any K
    under 16,000), covered by the factor 1.001.  ||bf16(v)|| <= (1 + 2^-8) ||v|| for any v."""
    in_features = panels.shape[1]
    if in_features * _U > 1e-3:
        raise ValueError(f"hidden size {in_features} is too large for the screen's bound")
    gamma = in_features * _U / (1.0 - in_features * _U)
    grow = 1.0 + 2.0 ** -8
    widened = pairs = w_max = 0.0
    step = max(1, _CHUNK_BYTES // (NR * in_features * 4))
    for start in range(0, panels.shape[0], step):
        exact = panels[start:start + step]
        diff = (exact - screen[start:start + step].float()).norm(dim=1)
        norm = exact.norm(dim=1)
        widened = max(widened, float((diff + gamma * (1.0 + grow) * norm).max()))
        pairs = max(pairs, float((diff + gamma * (1.0 + grow * grow) * norm).max()))
        w_max = max(w_max, float(norm.max()))
    if not max(widened, pairs, w_max) < float("inf"):
        raise ValueError("the head's weights are too large for the screen's bound")
    return Bounds(widened * 1.001, pairs * 1.001, w_max * grow * 1.001)


def pair_panels(rounded: torch.Tensor) -> torch.Tensor:
    """bfloat16 panels [Q, K, 16] -> [Q, ceil(K/2), 16] int32: the k-pairs vdpbf16ps multiplies (k even low)."""
    groups, in_features, width = rounded.shape
    if in_features % 2:
        rounded = torch.cat([rounded, rounded.new_zeros(groups, 1, width)], dim=1)
    pairs = rounded.view(groups, -1, 2, width).transpose(2, 3).contiguous().view(torch.int32)
    return pairs.view(groups, -1, width)


def pair_rows(x: torch.Tensor) -> torch.Tensor:
    """float32 rows [R, K] -> bfloat16 pairs [R, ceil(K/2)] int32."""
    rounded = x.to(torch.bfloat16)
    if x.shape[1] % 2:
        rounded = torch.cat([rounded, rounded.new_zeros(x.shape[0], 1)], dim=1)
    return rounded.contiguous().view(torch.int32)


class HeadScreen:
    """The screen of one float32 `PanelLinear` head (which it reads, never changes).

    `kernel` "auto" takes the first the CPU has of "int8" (AVX512-VNNI), "pairs" (vdpbf16ps over bfloat16
    x and weights: AVX512-BF16) and "widened" (float32 x over bfloat16 panels).  `cap`: candidates per row
    before the row goes back to the full head (default: head_int8.CAP for int8, CAP for the others)."""

    def __init__(self, head: PanelLinear, cap: int | None = None, kernel: str = "auto") -> None:
        if not isinstance(head, PanelLinear) or head.weight.dtype != torch.float32:
            raise ValueError("the LM head screen needs a float32 panel head")
        if head.bias is not None:
            raise ValueError("the LM head screen needs a head without a bias")
        lib, bf16 = panel_linear._kernel(torch.float32), panel_linear._kernel(torch.bfloat16)
        if lib is None or bf16 is None:
            raise OSError(f"panel kernels unavailable: {panel_linear.unavailable_reason()}")
        if kernel not in KERNELS:
            raise ValueError(f"screen kernel {kernel!r} is not available here")
        self.head = head
        self.rows_screened = 0       # rows whose token the screen decided
        self.rows_full = 0           # rows sent back to the full head
        self.candidates = 0          # float32 logits computed for screened rows
        self.int8: head_int8.Int8Stage | None = None
        if kernel in ("auto", "int8"):
            try:
                self.int8 = head_int8.Int8Stage(head.weight, head.out_features, cap or head_int8.CAP)
            except OSError:
                if kernel == "int8":
                    raise ValueError("screen kernel 'int8' is not available here (no AVX512-VNNI)") from None
        self.judging = self.int8 is not None and kernel == "auto"    # auto may still leave int8 (JUDGE_ROWS)
        self.judged = [0, 0, 0]      # rows, rows sent to the full head, candidates while judging
        self.draws = [0, 0]          # sampled rows through the screen: drawn, sent to the full head
        self.switched = ""           # why auto left int8, if it did
        if self.int8 is not None:
            self.kernel, self.cap, self.bound = "int8", self.int8.cap, 0.0
            self.weights = self.int8.weights
            self.extra_bytes = self.int8.extra_bytes
            return
        self._setup_bfloat16(kernel, cap, lib, bf16)

    def _setup_bfloat16(self, kernel: str, cap: int | None, lib: object, bf16: object) -> None:
        head = self.head
        self.cap = cap or CAP
        # panelize(W) rounded = panelize(W rounded): the bfloat16 panels come straight from the float32 ones
        rounded = head.weight.to(torch.bfloat16)
        if not torch.isfinite(rounded).all():
            raise ValueError("the head's weights do not fit bfloat16")
        self.bounds = weight_bounds(head.weight, rounded)
        has_pairs = hasattr(bf16, "epd_panel_dp")
        if kernel == "pairs" and not has_pairs:
            raise ValueError(f"screen kernel {kernel!r} is not available here")
        self.kernel = "pairs" if kernel == "pairs" or (kernel == "auto" and has_pairs) else "widened"
        if self.kernel == "pairs":
            self.weights = pair_panels(rounded)
            del rounded
            if self.weights.data_ptr() % 64:
                raise ValueError("pair panels must be 64-byte aligned")
            self._dp = bf16.epd_panel_dp  # type: ignore[attr-defined]
            ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
            self._dp.argtypes = [ptr, i64, i32, ptr, i32, i32, ptr, i64, i32]
            self._dp.restype = i32
            self.bound = self.bounds.pairs
        else:
            self.screen = PanelLinear.from_panels(rounded, head.out_features)
            self.weights = self.screen.weight
            self.bound = self.bounds.widened
        self.extra_bytes = self.weights.numel() * self.weights.element_size()
        fn = lib.epd_screen_argmax  # type: ignore[attr-defined]
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [ptr, i64, i32, i32, ptr, ptr, i64, ptr, i32, i32, ptr, ptr, i32]
        fn.restype = i32
        self._fn = fn

    def values(self, x: torch.Tensor, bound_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The screen's logits [R, N] of contiguous float32 rows, and each row's bound eps [R] (float64);
        bfloat16 kernels only."""
        if self.int8 is not None:
            raise ValueError("the int8 kernel has no uniform bound: Int8Stage computes its own")
        norms = x.double().norm(dim=1)
        if self.kernel == "widened":
            return self.screen(x), (norms * (self.bounds.widened * bound_scale)).contiguous()
        pairs = pair_rows(x)
        rows, out_features = x.shape[0], self.head.out_features
        out = torch.empty(rows, out_features, dtype=torch.float32)
        if self._dp(pairs.data_ptr(), pairs.stride(0), rows, self.weights.data_ptr(), out_features,
                    self.weights.shape[1], out.data_ptr(), out.stride(0), torch.get_num_threads()):
            raise ValueError(f"the pair kernel refused x {tuple(x.shape)}")
        rounding = (x.double() - pairs.view(torch.bfloat16)[:, :x.shape[1]].double()).norm(dim=1)
        tiny = 2.0 ** -120 * x.shape[1] * (1.0 + norms) * (1.0 + self.bounds.w_max)   # flushed denormals
        eps = norms * self.bounds.pairs + rounding * self.bounds.w_max + tiny
        return out, (eps * bound_scale).contiguous()

    @property
    def samples(self) -> bool:
        """Whether temperature rows may be drawn through the screen (services/sampling/screened.py): int8 only,
        until its first JUDGE_ROWS drawn rows sent more than JUDGE_FULL of them to the full head."""
        drawn, full = self.draws
        return self.int8 is not None and not (drawn >= JUDGE_ROWS and full > JUDGE_FULL * drawn)

    def sampled(self, rows: int, decided: int) -> None:
        """screened.draw's count: `decided` of `rows` drawn rows were decided by the screen."""
        self.rows_screened += decided
        self.rows_full += rows - decided
        if self.draws[0] < JUDGE_ROWS:
            self.draws[0] += rows
            self.draws[1] += rows - decided
            if not self.samples:
                logger.info("lm head screen: temperature rows go to the full head (%d of the first %d drawn "
                            "through the screen were not decided there)", self.draws[1], self.draws[0])

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor, bound_scale: float = 1.0) -> list[int]:
        """Greedy token of each row of `hidden` [R, K] (float32), or -1 where the full head must decide.

        `bound_scale` exists for the tests' negative control only (0: trust the screen blindly)."""
        if hidden.dtype != torch.float32 or hidden.dim() != 2 or hidden.shape[1] != self.head.in_features:
            raise TypeError(f"hidden must be float32 [R, {self.head.in_features}], got {hidden.dtype} "
                            f"{tuple(hidden.shape)}")
        x = hidden.contiguous()
        rows = x.shape[0]
        if self.int8 is not None:
            tokens, counts = self.int8.argmax(x, bound_scale)
            if self.judging:
                self._judge(tokens, counts)
        else:
            screen, eps = self.values(x, bound_scale)
            tokens = torch.empty(rows, dtype=torch.int64)
            counts = torch.empty(rows, dtype=torch.int64)
            status = self._fn(screen.data_ptr(), screen.stride(0), rows, self.head.out_features, eps.data_ptr(),
                              x.data_ptr(), x.stride(0), self.head.weight.data_ptr(), self.head.in_features,
                              self.cap, tokens.data_ptr(), counts.data_ptr(), torch.get_num_threads())
            if status:
                raise ValueError(f"the screen refused hidden {tuple(hidden.shape)}")
        picked = tokens.tolist()
        full = sum(1 for token in picked if token < 0)
        self.rows_full += full
        self.rows_screened += rows - full
        self.candidates += int(counts[tokens >= 0].sum())
        return picked

    def _judge(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """auto's verdict on int8 after JUDGE_ROWS real rows (see JUDGE_ROWS)."""
        decided = tokens >= 0
        self.judged[0] += tokens.numel()
        self.judged[1] += int((~decided).sum())
        self.judged[2] += int(counts[decided].sum())
        rows, full, candidates = self.judged
        if rows < JUDGE_ROWS:
            return
        self.judging = False
        per_row = candidates / max(rows - full, 1)
        if full <= JUDGE_FULL * rows and per_row <= JUDGE_CANDIDATES:
            return
        why = (f"int8 sent {full} of its first {rows} rows to the full head and left {per_row:.0f} float32 logits "
               f"per screened row")
        try:
            lib, bf16 = panel_linear._kernel(torch.float32), panel_linear._kernel(torch.bfloat16)
            self._setup_bfloat16("auto", None, lib, bf16)
        except ValueError as exc:
            logger.info("lm head screen stays on int8 (%s; the bfloat16 screen does not apply: %s)", why, exc)
            return
        self.int8 = None
        self.switched = why
        logger.info("lm head screen: auto moved from int8 to the bfloat16 %s kernel (%s)", self.kernel, why)


def screen_head_mode(linear_kernel: str, lm_head_screen: str, head: object = None) -> str | None:
    """The LM head's kernel where the screen decides it: the screen reads a panel head, so auto must not time the
    head onto another kernel.  `--lm-head-screen on`: always (on a small head oneDNN can win the timing, and the
    role would then refuse to start).  auto: where the int8 screen will run (AVX512-VNNI; `head` float32, without a
    bias, at least AUTO_MIN_HIDDEN wide), since greedy and plain temperature rows then never run the head (at 64
    rows oneDNN times faster on the medium head and auto used to leave the screen off there); only rows that need
    every logit do.  None leaves the head to `--linear-kernel`."""
    if linear_kernel != "auto":
        return None
    if lm_head_screen == "on":
        return "panel"
    weight = getattr(head, "weight", None)
    if (lm_head_screen == "auto" and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
            and getattr(head, "bias", None) is None and getattr(head, "in_features", 0) >= AUTO_MIN_HIDDEN):
        try:
            head_int8.library()
        except OSError:
            return None
        return "panel"
    return None


def build_screen(head: object, mode: str) -> tuple[HeadScreen | None, ScreenReport]:
    """The screen for `head` under --lm-head-screen `mode`; "on" raises ValueError where it cannot apply."""
    if mode not in MODES:
        raise ValueError(f"unknown --lm-head-screen {mode!r}; supported: {', '.join(MODES)}")
    if mode == "off":
        return None, ScreenReport(mode, False, "--lm-head-screen off")
    hidden = getattr(head, "in_features", 0)
    applies = isinstance(head, PanelLinear) and head.weight.dtype == torch.float32 and head.bias is None
    if mode == "auto" and applies and hidden < AUTO_MIN_HIDDEN:
        return None, ScreenReport(mode, False, f"hidden size {hidden} < {AUTO_MIN_HIDDEN}: not worth it (auto)")
    try:
        screen = HeadScreen(head)  # type: ignore[arg-type]
    except (ValueError, OSError) as exc:
        if mode == "on":
            raise ValueError(f"--lm-head-screen on: {exc}") from None
        return None, ScreenReport(mode, False, str(exc))
    reason = f"--lm-head-screen {mode}"
    if screen.judging:
        reason += f"; judged on its first {JUDGE_ROWS} rows, the bfloat16 pairs if int8 does not suit them"
    report = ScreenReport(mode, True, reason, screen.extra_bytes, screen.bound, screen.kernel)
    return screen, report


__all__ = ["CAP", "JUDGE_ROWS", "KERNELS", "MODES", "NR", "Bounds", "HeadScreen", "ScreenReport", "build_screen",
           "pair_panels", "pair_rows", "screen_head_mode", "weight_bounds"]
