"""Would an int8 first stage make the LM head screen cheaper?  A prototype measured against today's screen.

    python -m benchmarks.int8_screen            # the medium demo model's head, 1, 4, 8 and 16 rows
    python -m benchmarks.int8_screen --quick    # SmolLM2's head at 1 and 16 rows, few rounds (docs untouched)

Today's screen (services/models/head_screen.py) computes every row's logits from a bfloat16 copy of the head
with vdpbf16ps (two products per lane and instruction), then decides the token in float32 on the columns a
proven bound leaves.  The prototype (benchmarks/kernels/int8_screen.c, not used by the servers) computes the
same logits from int8 weights (per-column scales) and uint8 x (per-row scale, + 128) with AVX512-VNNI's
vpdpbusd, four products per lane and instruction, half the bytes again.  Per batch size, rounds alternating:

- time of the int8 logits (x's quantization included) / the bfloat16 pair logits (`HeadScreen.values`), and
  / the full float32 panel head;
- the integer sums, checked exact against torch's int64 matmul;
- how many columns each stage's bound leaves per row: the bfloat16 screen's eps, and for int8 the
  Cauchy-Schwarz bound |s_j t D_j - w_j . x| <= ||w^_j - w_j|| ||x^|| + ||w_j|| ||x^ - x|| plus the float32
  head's own summation error, once as one eps per row (its maximum over j, as today's screen) and once per
  column.  Rows are the model's final norm of random states.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json

SOURCE = Path(__file__).with_name("kernels") / "int8_screen.c"


def _library() -> Any:
    from services.models.panel_linear import _FLAGS
    from services.native import build_library

    lib = build_library(SOURCE, "int8_screen", _FLAGS)
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.epd_int8_screen.argtypes = [ptr, i64, i32, ptr, i32, i32, ptr, i64, i32]
    lib.epd_int8_screen.restype = i32
    return lib


class Int8Head:
    """The head's int8 copy in the prototype's panels, its scales and column sums, and its bound's terms."""

    def __init__(self, weight: Any) -> None:
        import numpy as np
        import torch

        n, k = weight.shape
        if n % 32 or k % 4:
            raise ValueError(f"the prototype needs N % 32 == 0 and K % 4 == 0, got {tuple(weight.shape)}")
        w = weight.detach().double()
        self.scale = (w.abs().amax(1) / 127).clamp_min(1e-30)                     # per column j
        q = torch.round(w / self.scale[:, None]).to(torch.int8)                    # [N, K]
        self.colsum = q.to(torch.int64).sum(1)
        self.q = q
        panels = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        flat = torch.from_numpy(np.ascontiguousarray(panels.numpy()).view(np.int32).reshape(-1).copy())
        room = torch.empty(flat.numel() + 16, dtype=torch.int32)
        start = (-room.data_ptr() // 4) % 16                                       # 64-byte aligned
        self.panels = room[start:start + flat.numel()]
        self.panels.copy_(flat)
        self.n, self.k = n, k
        self.err_w = (q.double() * self.scale[:, None] - w).norm(dim=1)   # ||w^_j - w_j|| per column j
        self.norm_w = w.norm(dim=1)                                         # ||w_j||
        self.lib = _library()

    def sums(self, x: Any) -> tuple[Any, Any, Any]:
        """(int32 sums [M, N] of uint8 x . int8 w, the uint8 x, the per-row scale t)."""
        import torch

        t = (x.abs().amax(1, keepdim=True) / 127).clamp_min(1e-30)
        xu = (torch.round(x / t) + 128).to(torch.uint8).contiguous()
        xp = xu.view(torch.int32)
        out = torch.empty(x.shape[0], self.n, dtype=torch.int32)
        if self.lib.epd_int8_screen(xp.data_ptr(), xp.stride(0), x.shape[0], self.panels.data_ptr(), self.n,
                                    self.k // 4, out.data_ptr(), out.stride(0), torch.get_num_threads()):
            raise ValueError("the int8 prototype refused the shapes")
        return out, xu, t

    def candidates(self, x: Any) -> tuple[list[int], list[int]]:
        """How many columns each row's bound leaves: one eps per row, one per column (`kept`)."""
        per_row, per_column = self.kept(x)
        return per_row.sum(1).tolist(), per_column.sum(1).tolist()

    def kept(self, x: Any) -> tuple[Any, Any]:
        """The columns [M, N] each row's bound leaves (int8 logits, Cauchy-Schwarz): with one eps per row (the
        maximum over columns, as today's screen), and with eps_j per column (a column stays if logit_j + eps_j
        reaches the largest logit_i - eps_i).  Either way the float32 head's argmax column is among them."""
        import torch

        out, xu, t = self.sums(x)
        xhat = (xu.double() - 128) * t.double()
        logits = (out.to(torch.int64) - 128 * self.colsum).double() * self.scale[None, :] * t.double()
        gamma = self.k * 2.0 ** -24 / (1 - self.k * 2.0 ** -24)
        eps = (self.err_w[None, :] * xhat.norm(dim=1)[:, None] + self.norm_w[None, :] * (xhat - x.double()).norm(
            dim=1)[:, None] + gamma * self.norm_w[None, :] * x.double().norm(dim=1)[:, None])   # [M, N]
        uniform = eps.max(1).values
        per_row = logits >= (logits.max(1).values - 2 * uniform)[:, None]
        per_column = logits + eps >= (logits - eps).max(1).values[:, None]
        return per_row, per_column


def measure(model: str, batches: list[int], rounds: int) -> dict[str, Any]:
    import torch

    from benchmarks.decode_step import MODELS
    from services.models.head_screen import HeadScreen
    from services.models.panel_linear import PanelLinear
    from services.models.registry import adapter_for, resolve_model

    path = resolve_model(MODELS[model])
    lm = adapter_for(path).load_language(path, "cpu", "float32")
    weight = lm.lm_head.weight.detach().clone()
    head = PanelLinear(_linear_of(weight))
    screen = HeadScreen(head)
    int8 = Int8Head(weight)
    gen = torch.Generator().manual_seed(3)
    times: dict[str, list[float]] = {}
    candidates: dict[str, list[int]] = {}
    exact = True
    with torch.inference_mode():
        for batch in batches:
            x = lm.model.norm(torch.randn(batch, weight.shape[1], generator=gen) * 4).contiguous()
            out, xu, _ = int8.sums(x)
            exact &= torch.equal(out.to(torch.int64) - 128 * int8.colsum,
                                 (xu.to(torch.int64) - 128) @ int8.q.to(torch.int64).T)
            sides = {"int8": lambda x=x: int8.sums(x), "bf16": lambda x=x: screen.values(x),
                     "float32": lambda x=x: head(x)}
            for side in sides.values():
                side()
            for round_index in range(rounds):
                for name in (list(sides) if round_index % 2 == 0 else list(reversed(sides))):
                    began = time.perf_counter()
                    sides[name]()
                    times.setdefault(f"{batch}:{name}", []).append((time.perf_counter() - began) * 1e3)
            values, eps = screen.values(x)
            top = values.max(1).values.double()
            candidates[f"{batch}:bf16"] = (values.double() >= (top - 2 * eps)[:, None]).sum(1).tolist()
            candidates[f"{batch}:int8"], candidates[f"{batch}:int8_per_column"] = int8.candidates(x)
    return {"model": model, "shape": list(weight.shape), "exact_int_sums": exact, "times_ms": times,
            "candidates": candidates}


def _linear_of(weight: Any) -> Any:
    import torch

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return linear


def figures_of(result: dict[str, Any], batches: list[int]) -> list[Figure]:
    out = []
    for batch in batches:
        t = {side: median(result["times_ms"][f"{batch}:{side}"]) for side in ("int8", "bf16", "float32")}
        c8, c8j = result["candidates"][f"{batch}:int8"], result["candidates"][f"{batch}:int8_per_column"]
        c16 = result["candidates"][f"{batch}:bf16"]
        note = (f"int8 {t['int8']:.2f} vs bf16 pairs {t['bf16']:.2f} vs float32 {t['float32']:.2f} ms; columns left "
                f"per row: int8 median {median(c8):.0f} (max {max(c8)}), int8 with a bound per column median "
                f"{median(c8j):.0f} (max {max(c8j)}), bf16 median {median(c16):.0f} (max {max(c16)}); integer "
                f"sums exact: {result['exact_int_sums']}")
        name = f"LM head logits, {result['model']}, {batch} rows: int8 VNNI / bf16 pairs"
        out.append(Figure(name, t["int8"] / t["bf16"], None, "le", note=note))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="SmolLM2's head, 1 and 16 rows, few rounds")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    model, batches = ("smollm2", [1, 16]) if args.quick else ("medium", [1, 4, 8, 16])
    rounds = args.rounds or (3 if args.quick else 12)
    where = machine()
    result = measure(model, batches, rounds)
    figures = figures_of(result, batches)
    print_figures(figures, "int8 prototype vs the bfloat16 screen")
    write_json({"figures": figures, "result": result, "machine": where},
               results_dir(args.quick) / "int8_screen.json")
    if not args.quick and not args.no_docs:
        write_doc_block("int8-screen", "python -m benchmarks.int8_screen", figures)
    return 0 if result["exact_int_sums"] else 1


if __name__ == "__main__":
    sys.exit(main())
