"""The LM head screen's int8 stage: greedy tokens of a float32 panel head from an int8 copy of its weights.

`HeadScreen` (services/models/head_screen.py) runs this stage where the CPU has AVX512-VNNI (kernel "int8").
The copy holds each column j of the head (a vocabulary row W_j) as int8 q_j with its own scale s_j
(q_j = round(W_j / s_j), s_j = max|W_j| / 127): a quarter of the float32 head's bytes, half the bfloat16
screen's.  Each row x is quantized too: t = max|x| / 127, xu = round(x / t) + 128 (uint8), x^ = (xu - 128) t.
The kernel (services/kernels/head_int8.c) sums xu . q_j in int32 with vpdpbusd (exact), so

    L_j = (xu . q_j - 128 sum_k q_jk) s_j t = (s_j q_j) . x^        exactly (computed in double).

The float32 head's logit l_j = fl(W_j . x) (any order of K products) is within

    |l_j - L_j| <= ||s_j q_j - W_j|| ||x^|| + ||W_j|| ||x^ - x|| + gamma_K ||W_j|| ||x|| + tiny = E_j

(Cauchy-Schwarz on both roundings, the standard bound of a float32 sum, and a term for flushed denormals;
gamma_K = K u / (1 - K u), u = 2^-24).  The column constants carry a factor 1.001 that also covers the double
arithmetic's own rounding (relative 1e-16, against E_j >= gamma_K ||W_j|| ||x|| ~ 6e-5 |L_j| at K = 1024).
So the float32 argmax j* has L_j* + E_j* >= l_j* >= max_i l_i >= max_i (L_i - E_i): every column whose upper
value L_j + E_j reaches max_i (L_i - E_i) is a candidate, j* and its ties among them.  The candidates' float32
logits come from the head's own panels (one in-order fused multiply-add chain per column, as the full head's
kernel: the same bits), and the first largest wins.

One eps per row (the bfloat16 screen's) would be loose here: int8 errors differ from column to column, and
the maximum over 151,936 columns kept 107-639 columns per row on the medium head (docs/benchmarks.md); the
per-column E_j keeps tens.  The cap on candidates is larger than the bfloat16 screen's: a candidate costs one
panel (64 KiB at K = 1024) of the float32 head, against 622 MB for the row's full head.
"""

from __future__ import annotations

import ctypes

import torch

from services import kernels
from services.models.panel_linear import NR

CAP = 1024            # candidates per row before the row falls back to the full head
LIST_CAP = 4096       # columns a kernel thread may keep per row while its lower bound rises
_U = 2.0 ** -24
# The copy is built a chunk of panels at a time in float64 buffers of about this size, reused by every chunk:
# new temporaries per op, 64 MB each (512 panels of the medium model's 151936x1024 head), were blocks glibc maps
# fresh from the kernel every time: 1.9 million minor page faults and 5.0 s at start-up, against 0.04 million (the
# copy's own pages) and 0.9 s with the buffers, the same bytes (tests/services/models/test_head_int8.py)
_CHUNK_BYTES = 1 << 20
_LIB: list[object] = []


def library() -> object:
    """The loaded kernel; raises OSError (KernelUnavailable) where none runs (no AVX512-VNNI)."""
    if not _LIB:
        lib = kernels.library("head_int8")
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.epd_i8_argmax.argtypes = [ptr, i64, i32, ptr, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i32,
                                      i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32]
        lib.epd_i8_argmax.restype = i32
        lib.epd_i8_upper.argtypes = [ptr, i64, i32, ptr, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32]
        lib.epd_i8_upper.restype = i32
        lib.epd_i8_at.argtypes = [ptr, i64, ptr, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i32, ptr, ptr,
                                  i32, ptr, ptr, i32]
        lib.epd_i8_at.restype = i32
        _LIB.append(lib)
    return _LIB[0]


def _aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    room = torch.empty(numel + 64, dtype=dtype)
    size = room.element_size()
    start = (-room.data_ptr() // size) % (64 // size)
    return room[start:start + numel]


class Int8Stage:
    """The int8 copy of a float32 panel head [Q, K, 16] with N columns, and the argmax through it."""

    def __init__(self, panels: torch.Tensor, out_features: int, cap: int = CAP) -> None:
        if panels.dtype != torch.float32 or panels.dim() != 3 or panels.shape[2] != NR:
            raise ValueError("the int8 stage needs float32 panels [Q, K, 16]")
        self.lib = library()
        groups, in_features, _ = panels.shape
        if in_features * _U > 1e-3:
            raise ValueError(f"hidden size {in_features} is too large for the screen's bound")
        self.n, self.k, self.cap, self.list_cap = out_features, in_features, cap, LIST_CAP
        self.k4 = (in_features + 3) // 4
        self.q8 = groups + groups % 2                  # whole pairs of panels
        width = self.q8 * NR
        self.weights = _aligned(self.q8 * self.k4 * NR, torch.int32)
        self.weights.zero_()
        view = self.weights.view(self.q8, self.k4, NR)
        self.colsum = torch.zeros(width, dtype=torch.int32)
        self.scale = torch.zeros(width, dtype=torch.float64)
        self.ew = torch.zeros(width, dtype=torch.float64)
        self.nw = torch.zeros(width, dtype=torch.float64)
        chunk = max(1, _CHUNK_BYTES // (NR * in_features * 8))
        # three float64 buffers [chunk, K, 16] reused by every chunk, read as [c, 16, K] (the panels' layout)
        w_buf, t_buf, q_buf = (torch.empty(chunk, in_features, NR, dtype=torch.float64) for _ in range(3))
        q8 = torch.zeros(chunk, NR, 4 * self.k4, dtype=torch.int8)               # its padding stays 0
        for start in range(0, groups, chunk):
            count = min(chunk, groups - start)
            w_buf[:count].copy_(panels[start:start + count])
            w, t, q = (b[:count].transpose(1, 2) for b in (w_buf, t_buf, q_buf))   # [c, 16, K]
            scale = (torch.abs(w, out=t).amax(2) / 127).clamp_min(1e-300)      # [c, 16]
            torch.div(w, scale[:, :, None], out=q).round_()
            cols = slice(start * NR, (start + count) * NR)
            self.scale[cols] = scale.reshape(-1)
            self.ew[cols] = torch.mul(q, scale[:, :, None], out=t).sub_(w).norm(dim=2).reshape(-1)
            self.nw[cols] = w.norm(dim=2).reshape(-1)
            self.colsum[cols] = (128 * q.sum(2)).to(torch.int32).reshape(-1)
            q8[:count, :, :in_features] = q                                    # whole numbers in [-127, 127]
            # [c, 16, K4, 4] -> [c, K4, 16, 4]: lane j of k-group g holds q[j, 4g .. 4g + 3]
            view[start:start + count] = q8[:count].view(count, NR, self.k4, 4).transpose(1, 2).contiguous().view(
                torch.int32).view(count, self.k4, NR)
        self.ew *= 1.001
        self.nw *= 1.001
        if not (torch.isfinite(self.ew).all() and torch.isfinite(self.nw).all()):
            raise ValueError("the head's weights are too large for the screen's bound")
        self.w_max = float(self.nw.max())
        # the mean E_j of a row is rowc[A, B, C] @ these (`upper`): computed once, not per step
        self.mean_bound = torch.stack([self.ew[:out_features].mean(), self.nw[:out_features].mean(),
                                       torch.tensor(1.0, dtype=torch.float64)])
        self.gamma = in_features * _U / (1.0 - in_features * _U)
        self.panels = panels
        self.extra_bytes = sum(t.numel() * t.element_size() for t in (self.weights, self.colsum, self.scale, self.ew,
                                                                       self.nw))

    def row_constants(self, x: torch.Tensor, bound_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(xu as int32 groups [R, K4], the rows' t, A, B, C [R, 4] in double); t NaN for a non-finite row."""
        rows = x.shape[0]
        xd = x.double()
        finite = torch.isfinite(xd).all(dim=1)
        xd = torch.where(finite[:, None], xd, 0.0)
        t = (xd.abs().amax(dim=1) / 127).clamp_min(1e-300)
        levels = torch.round(xd / t[:, None])
        xu = torch.full((rows, 4 * self.k4), 128, dtype=torch.uint8)
        xu[:, :self.k] = (levels + 128).to(torch.uint8)
        xhat = levels * t[:, None]
        norm_x = xd.norm(dim=1)
        tiny = 2.0 ** -120 * self.k * (1.0 + norm_x) * (1.0 + self.w_max)
        rowc = torch.stack([torch.where(finite, t, float("nan")), xhat.norm(dim=1) * 1.001 * bound_scale,
                            ((xhat - xd).norm(dim=1) + self.gamma * norm_x) * 1.001 * bound_scale,
                            tiny * bound_scale], dim=1).contiguous()
        return xu.view(torch.int32), rowc

    def argmax(self, x: torch.Tensor, bound_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [R] int64, -1 where the full head must decide; candidates per row [R]) of contiguous
        float32 rows x [R, K]."""
        rows = x.shape[0]
        xp, rowc = self.row_constants(x, bound_scale)
        threads = torch.get_num_threads()
        lists = torch.empty(threads, rows, self.list_cap, dtype=torch.int32)
        uvals = torch.empty(threads, rows, self.list_cap, dtype=torch.float32)
        lens = torch.empty(threads, rows, dtype=torch.int32)
        lows = torch.empty(threads, rows, dtype=torch.float64)
        cands = torch.empty(rows, self.cap, dtype=torch.int32)
        tokens = torch.empty(rows, dtype=torch.int64)
        counts = torch.empty(rows, dtype=torch.int64)
        if self.lib.epd_i8_argmax(xp.data_ptr(), xp.stride(0), rows, self.weights.data_ptr(), self.n, self.q8,  # type: ignore[attr-defined]
                                  self.k4, self.colsum.data_ptr(), self.scale.data_ptr(), self.ew.data_ptr(),
                                  self.nw.data_ptr(), rowc.data_ptr(), x.data_ptr(), x.stride(0),
                                  self.panels.data_ptr(), self.k, self.cap, self.list_cap, lists.data_ptr(),
                                  uvals.data_ptr(), lens.data_ptr(), lows.data_ptr(), cands.data_ptr(),
                                  tokens.data_ptr(), counts.data_ptr(), threads):
            raise ValueError(f"the int8 screen refused x {tuple(x.shape)}")
        return tokens, counts

    def upper(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Every column's upper value U_j = L_j + E_j rounded up to float32 ([R, N]) of contiguous float32 rows x
        [R, K] (no column's float32 logit is above it; a row with a NaN or an infinity gets NaN), each row's mean
        E_j [R] (double: about how far U lies above the logits), and the rows' constants for `at`."""
        rows = x.shape[0]
        xp, rowc = self.row_constants(x)
        out = torch.empty(rows, self.n, dtype=torch.float32)
        if self.lib.epd_i8_upper(xp.data_ptr(), xp.stride(0), rows, self.weights.data_ptr(), self.n, self.q8,  # type: ignore[attr-defined]
                                 self.k4, self.colsum.data_ptr(), self.scale.data_ptr(), self.ew.data_ptr(),
                                 self.nw.data_ptr(), rowc.data_ptr(), out.data_ptr(), out.stride(0),
                                 torch.get_num_threads()):
            raise ValueError(f"the int8 screen refused x {tuple(x.shape)}")
        return out, rowc[:, 1:] @ self.mean_bound, (xp, rowc)

    def at(self, x: torch.Tensor, consts: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logit as the full head computes it, U as `upper` computes it) of each (row, column) pair:
        `rows` and `cols` int32 [n]; `consts` is what `upper` returned for the same x."""
        xp, rowc = consts
        n = rows.numel()
        logit, upper = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        rows, cols = rows.to(torch.int32).contiguous(), cols.to(torch.int32).contiguous()
        if self.lib.epd_i8_at(xp.data_ptr(), xp.stride(0), self.weights.data_ptr(), self.n, self.q8, self.k4,  # type: ignore[attr-defined]
                              self.colsum.data_ptr(), self.scale.data_ptr(), self.ew.data_ptr(), self.nw.data_ptr(),
                              rowc.data_ptr(), x.data_ptr(), x.stride(0), self.panels.data_ptr(), self.k,
                              rows.data_ptr(), cols.data_ptr(), n, logit.data_ptr(), upper.data_ptr(),
                              torch.get_num_threads()):
            raise ValueError(f"the int8 screen refused {n} (row, column) pairs")
        return logit, upper

__all__ = ["CAP", "Int8Stage", "library"]
