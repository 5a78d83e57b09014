"""The fused decode step: the whole decoder stack of a step in one C call (services/kernels/fused_step.c).

Why: an eager step dispatches ~25 torch ops per layer from Python, and with two threads each one is
an OpenMP fork/join; on SmolLM2 (30 layers) that is a third of a one-row step on this project's 2-core
box.  The fused kernel runs norms, q/k/v, RoPE, the KV write, paged attention, o_proj, the SiLU MLP
and the residual adds of every layer inside one OpenMP parallel region (five barriers per layer),
over the panel kernel's weights (services/kernels/panel.c) and the paged attention's
(services/kernels/paged_attention.c) per-row code.  The embedding lookup, RoPE's cos/sin, the final norm
and the LM head stay in torch.

Where it applies (`unsupported_reason` says why not): float32 activations and KV on CPU, over float32
panels or bfloat16 ones (decode's `--dtype bfloat16`: fused_step_bf16, built with -DEPD_PANEL_BF16); Llama /
Qwen2 / Qwen2-VL / Qwen2.5-VL / Qwen3-VL shaped layers (the paged forward's set, services/decode/paged_forward.py) whose
seven linears are all panel layers (`--linear-kernel panel`, or auto, which the decode role steers to
panels for the stack when the fused step is on, services/decode/app.py), RMSNorms, a SiLU-gated MLP;
the kernels' limits (head_dim <= 256 and even, <= 32 query heads per KV head, blocks <= 256 tokens).

`--decode-fused auto|on|off` (services/config/__init__.py): auto uses it wherever it applies, on refuses to
start where it does not, off never uses it.  The start-up log and /metrics name the step mode
("fused").  Its logits agree with the eager step's to ~1e-6 relative (tests/services/decode/test_fused.py).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch
from torch import nn

from services import kernels
from services.decode.paged_forward import PagedDecoder
from services.hostcpu import compute_threads
from services.models.panel_linear import PanelLinear

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
LIBRARIES = {torch.float32: "fused_step", torch.bfloat16: "fused_step_bf16"}   # services/kernels/spec.py
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MAX_GROUP, _MAX_DIM, _MAX_BLOCK = 32, 256, 256   # fused_step.c's (paged_attention.c's) fixed limits

_P = ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("w", _P * 7), ("b", _P * 7), ("keys", _P), ("values", _P)]


class _Scratch(ctypes.Structure):
    _fields_ = [*((name, _P) for name in ("x", "alt", "q", "k", "v", "attn", "tmp", "gate", "up")),
                ("x_threads", ctypes.c_int)]


def _kernel(weight_dtype: torch.dtype = torch.float32) -> Any:
    """The fused step's library for float32 or bfloat16 panels (fused_step.c's two builds), or None."""
    try:
        lib = kernels.library(LIBRARIES[weight_dtype])
    except OSError:
        return None
    fn = lib.epd_fused_step
    i32, i64, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_float
    fn.argtypes = [_P, i32, _P, i32, i32, i32, i32, i32, i32, f32, f32, _P, _P, _P, _P, _P, i64, _P, i32, f32, _P,
                   i32]
    fn.restype = i32
    return lib


def _yield_to_prompt(lib: Any) -> tuple[Any, list[Any]]:
    """Point the step's per-layer yield (fused_step.c's epd_fused_yield_to) at the compute lease's board where this
    decode follows one (services/hostcpu/compute_lease.py), or at none; (the library's pause counter, the boards'
    buffers: the step keeps them so the memory the kernel reads stays mapped)."""
    from services.hostcpu import compute_lease, role_cpu

    setter, counter = lib.epd_fused_yield_to, lib.epd_fused_yielded_ns
    setter.argtypes = [_P, ctypes.c_int, _P, ctypes.c_int, ctypes.c_int64]
    setter.restype = None
    counter.argtypes, counter.restype = [], ctypes.c_int64
    follower, longs = compute_lease.follower(), role_cpu.long_board()
    if follower is None:
        setter(None, 0, None, 0, 0)   # the library's settings outlive a step: an earlier one's are undone
        return counter, []
    kept = [ctypes.c_char.from_buffer(follower.board)]
    if longs is not None:
        kept.append(ctypes.c_char.from_buffer(longs))
    setter(ctypes.addressof(kept[0]), compute_lease.BOARD_BYTES,
           ctypes.addressof(kept[1]) if longs is not None else None,
           role_cpu.LONG_BOARD_BYTES if longs is not None else 0, int(compute_lease.YIELD_BUDGET_S * 1e9))
    return counter, kept


def _is_rms_norm(module: Any) -> bool:
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    return (name.endswith("RMSNorm") and not name.startswith("Gemma") and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and hasattr(module, "variance_epsilon"))


def _is_silu(module: Any) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ in ("SiLUActivation", "SiLU")


def panel_dtype(decoder: PagedDecoder) -> torch.dtype:
    """The first layer's q_proj panels' dtype (float32, or bfloat16 for decode's --dtype bfloat16)."""
    weight = getattr(getattr(decoder.layers[0].self_attn, "q_proj", None), "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else torch.float32


def unsupported_reason(decoder: PagedDecoder) -> str:
    """Why the fused step cannot run this decoder ("" when it can)."""
    layout = decoder.lm.layout
    if layout.dtype != torch.float32 or decoder.pool.kv.device.type != "cpu":
        return f"needs float32 on CPU, got {layout.dtype} on {decoder.pool.kv.device}"
    if decoder.num_heads % decoder.num_kv_heads or decoder.num_heads // decoder.num_kv_heads > _MAX_GROUP:
        return f"{decoder.num_heads} query heads over {decoder.num_kv_heads} KV heads is beyond the kernel"
    if decoder.head_dim > _MAX_DIM or decoder.head_dim % 2 or decoder.pool.block_size > _MAX_BLOCK:
        return f"head_dim {decoder.head_dim} / block size {decoder.pool.block_size} is beyond the kernel"
    eps = {float(layer.input_layernorm.variance_epsilon) for layer in decoder.layers
           if _is_rms_norm(layer.input_layernorm)}
    for index, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(_is_rms_norm(norm) for norm in norms):
            return f"layer {index}'s norms are not RMSNorms"
        eps |= {float(norm.variance_epsilon) for norm in norms}
        if not all(hasattr(mlp, name) for name in _LINEARS[4:]) or not _is_silu(getattr(mlp, "act_fn", None)):
            return f"layer {index}'s MLP is not a SiLU-gated gate/up/down MLP"
        linears = [getattr(attn, name) for name in _LINEARS[:4]] + [getattr(mlp, name) for name in _LINEARS[4:]]
        if not all(isinstance(linear, PanelLinear) for linear in linears):
            return f"layer {index}'s linears are not panel layers (--linear-kernel panel)"
        if len({linear.weight.dtype for linear in linears} | {panel_dtype(decoder)}) != 1:
            return f"layer {index}'s panels mix float32 and bfloat16"
    if len(eps) != 1:
        return f"the norms' epsilons differ: {sorted(eps)}"
    if _kernel(panel_dtype(decoder)) is None:
        loaded = kernels.load(LIBRARIES[panel_dtype(decoder)])
        return f"the kernel does not run here: {loaded.variant} ({loaded.reason})"
    return ""


class FusedStep:
    """`step(token_ids, positions, write_blocks, write_offsets, tables, lens) -> logits`, as
    `PagedDecoder.forward`, for up to `max_rows` rows."""

    def __init__(self, decoder: PagedDecoder, max_rows: int) -> None:
        reason = unsupported_reason(decoder)
        if reason:
            raise ValueError(f"fused decode step: {reason}")
        self.decoder, self.max_rows = decoder, max_rows
        self.weight_dtype = panel_dtype(decoder)
        lib = _kernel(self.weight_dtype)
        self._fn = lib.epd_fused_step
        self._yielded_ns, self._boards = _yield_to_prompt(lib)
        first = decoder.layers[0]
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.intermediate = first.mlp.gate_proj.out_features
        self.eps = float(first.input_layernorm.variance_epsilon)
        self.qk_eps = float(first.self_attn.q_norm.variance_epsilon) if decoder.has_qk_norm else 0.0
        pool = decoder.pool
        self._layers = (_Layer * len(decoder.layers))()
        for index, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [getattr(attn, name) for name in _LINEARS[:4]] + [getattr(mlp, name) for name in _LINEARS[4:]]
            entry = self._layers[index]
            entry.in_norm = _ptr(layer.input_layernorm.weight)
            entry.post_norm = _ptr(layer.post_attention_layernorm.weight)
            if decoder.has_qk_norm:
                entry.q_norm, entry.k_norm = _ptr(attn.q_norm.weight), _ptr(attn.k_norm.weight)
            for slot, linear in enumerate(linears):
                entry.w[slot] = _ptr(linear.weight)
                entry.b[slot] = _ptr(linear.bias) if linear.bias is not None else None
            entry.keys, entry.values = _ptr(pool.kv[index, 0]), _ptr(pool.kv[index, 1])
        heads, kv_heads, dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
        # each thread keeps its own normed input
        self.max_threads = max(compute_threads.count(), torch.get_num_threads(), 1)
        widths = {"x": self.max_threads * self.hidden_size, "alt": self.hidden_size, "q": heads * dim,
                  "k": kv_heads * dim, "v": kv_heads * dim, "attn": heads * dim, "tmp": self.hidden_size,
                  "gate": self.intermediate, "up": self.intermediate}
        self._buffers = {name: torch.empty(max_rows, width, dtype=torch.float32) for name, width in widths.items()}
        self._scratch = _Scratch(**{name: _ptr(buf) for name, buf in self._buffers.items()},
                                 x_threads=self.max_threads)

    @property
    def yielded_s(self) -> float:
        """Seconds this process's fused steps paused for prompt-side forwards (fused_step.c's counter)."""
        return self._yielded_ns() / 1e9

    @torch.inference_mode()
    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, write_blocks: torch.Tensor,
                 write_offsets: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, head: bool = True
                 ) -> torch.Tensor:
        """Logits [B, vocab]; with `head=False` the final-normed hidden states [B, hidden] instead."""
        rows = token_ids.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"a fused step takes at most {self.max_rows} rows, got {rows}")
        decoder = self.decoder
        hidden = decoder.lm.embed(token_ids[:, None])[:, 0].contiguous().clone()   # written in place
        cos, sin = (t.contiguous() for t in decoder.rope(positions))
        for tensor, dtype in ((write_blocks, torch.int64), (write_offsets, torch.int64), (lens, torch.int32)):
            if tensor.dtype != dtype or not tensor.is_contiguous():
                raise TypeError(f"fused step inputs: expected contiguous {dtype}, got {tensor.dtype}")
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            raise TypeError("fused step inputs: tables must be int32 with contiguous rows")
        status = self._fn(ctypes.addressof(self._layers), len(decoder.layers), hidden.data_ptr(), rows,
                          self.hidden_size, decoder.num_heads, decoder.num_kv_heads, decoder.head_dim,
                          self.intermediate, self.eps, self.qk_eps, cos.data_ptr(), sin.data_ptr(),
                          write_blocks.data_ptr(), write_offsets.data_ptr(), tables.data_ptr(), tables.stride(0),
                          lens.data_ptr(), decoder.pool.block_size, decoder.scale, ctypes.byref(self._scratch),
                          torch.get_num_threads())
        if status:
            raise ValueError(f"the fused decode kernel refused a step of {rows} rows")
        hidden = decoder.norm(hidden)
        return decoder.lm.lm_head(hidden) if head else hidden


def choose_fused(decoder: PagedDecoder, mode: str, max_rows: int) -> tuple[FusedStep | None, str]:
    """(the fused step or None, why not); `mode` "on" raises ValueError where it does not apply."""
    if mode not in MODES:
        raise ValueError(f"unknown fused decode mode {mode!r}; supported: {', '.join(MODES)}")
    if mode == "off":
        return None, "off"
    reason = unsupported_reason(decoder)
    if reason:
        if mode == "on":
            raise ValueError(f"--decode-fused on: {reason}")
        return None, reason
    return FusedStep(decoder, max_rows), ""


def _ptr(tensor: torch.Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("fused step weights must be contiguous")
    return tensor.data_ptr()
