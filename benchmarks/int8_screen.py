"""The LM head screen's int8 stage against its bfloat16 pairs, and what each int8 bound would leave.

    python -m benchmarks.int8_screen            # the medium demo model's head, 1, 4, 8 and 16 rows
    python -m benchmarks.int8_screen --quick    # SmolLM2's head at 1 and 16 rows, few rounds (docs untouched)

The int8 stage (services/models/head_int8.py, its kernel head_int8.c) computes every row's logits from int8
weights (a scale per column) and uint8 x (a scale per row) with AVX512-VNNI's vpdpbusd, then the float32
logits of the columns its bound leaves.  This script began as the prototype of that stage and now measures
the product's: per batch size, rounds alternating,

- time of the int8 stage's argmax / the bfloat16 pairs screen's argmax, and / the full float32 panel head;
- how many columns each bound leaves per row, computed here in float64 from the stage's own int8 copy and
  constants: one eps per row (the maximum over columns, as the bfloat16 screen's bound) and one per column
  (the stage's: a column stays if L_j + E_j reaches max_i (L_i - E_i)), and the stage's own count.
Rows are the model's final norm of random states.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json


class Int8Head:
    """The product's int8 stage of a weight [N, K], and its bounds recomputed in float64 (`kept`)."""

    def __init__(self, weight: Any) -> None:
        import torch

        from services.models.head_int8 import Int8Stage
        from services.models.panel_linear import PanelLinear

        n, k = weight.shape
        self.head = PanelLinear(_linear_of(weight))
        self.stage = Int8Stage(self.head.weight, n)          # OSError where AVX512-VNNI is missing
        lanes = self.stage.weights.view(torch.int8).view(self.stage.q8, self.stage.k4, 16, 4)
        self.q = lanes.permute(0, 2, 1, 3).reshape(self.stage.q8 * 16, 4 * self.stage.k4)[:n, :k].contiguous()
        self.err_w, self.norm_w = self.stage.ew[:n].clone(), self.stage.nw[:n].clone()
        self.scale = self.stage.scale[:n]
        self.n, self.k = n, k

    def argmax(self, x: Any) -> tuple[Any, Any]:
        return self.stage.argmax(x.contiguous())

    def kept(self, x: Any) -> tuple[Any, Any]:
        """The columns [M, N] each bound leaves: one eps per row (its maximum over columns) and one per column.
        Either way the float32 head's argmax column is among them."""
        import torch

        xu, rowc = self.stage.row_constants(x.contiguous())
        levels = xu.view(torch.uint8)[:, :self.k].to(torch.int64) - 128
        logits = (levels @ self.q.to(torch.int64).T).double() * self.scale[None, :] * rowc[:, :1]
        eps = self.err_w[None, :] * rowc[:, 1:2] + self.norm_w[None, :] * rowc[:, 2:3] + rowc[:, 3:4]   # [M, N]
        uniform = eps.max(1).values
        per_row = logits >= (logits.max(1).values - 2 * uniform)[:, None]
        per_column = logits + eps >= (logits - eps).max(1).values[:, None]
        return per_row, per_column


def measure(model: str, batches: list[int], rounds: int) -> dict[str, Any]:
    import torch

    from benchmarks.decode_runner import MODELS
    from services.models.head_screen import HeadScreen
    from services.models.registry import adapter_for, resolve_model

    path = resolve_model(MODELS[model])
    lm = adapter_for(path).load_language(path, "cpu", "float32")
    weight = lm.lm_head.weight.detach().clone()
    int8 = Int8Head(weight)
    screen = HeadScreen(int8.head, kernel="pairs")
    gen = torch.Generator().manual_seed(3)
    times: dict[str, list[float]] = {}
    candidates: dict[str, list[int]] = {}
    same = True
    with torch.inference_mode():
        for batch in batches:
            x = lm.model.norm(torch.randn(batch, weight.shape[1], generator=gen) * 4).contiguous()
            sides = {"int8": lambda x=x: int8.argmax(x), "bf16": lambda x=x: screen.argmax(x),
                     "float32": lambda x=x: int8.head(x).max(dim=1).indices}
            full = sides["float32"]().tolist()
            tokens, counts = sides["int8"]()
            same &= all(t in (f, -1) for t, f in zip(tokens.tolist(), full, strict=True))
            same &= all(t in (f, -1) for t, f in zip(sides["bf16"](), full, strict=True))
            for round_index in range(rounds):
                for name in (list(sides) if round_index % 2 == 0 else list(reversed(sides))):
                    began = time.perf_counter()
                    sides[name]()
                    times.setdefault(f"{batch}:{name}", []).append((time.perf_counter() - began) * 1e3)
            values, eps = screen.values(x)
            top = values.max(1).values.double()
            candidates[f"{batch}:bf16"] = (values.double() >= (top - 2 * eps)[:, None]).sum(1).tolist()
            per_row, per_column = int8.kept(x)
            candidates[f"{batch}:int8"] = per_row.sum(1).tolist()
            candidates[f"{batch}:int8_per_column"] = per_column.sum(1).tolist()
            candidates[f"{batch}:int8_stage"] = counts.tolist()
    return {"model": model, "shape": list(weight.shape), "same_tokens": same, "times_ms": times,
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
                f"per row: int8 with one eps per row median {median(c8):.0f} (max {max(c8)}), with a bound per "
                f"column median {median(c8j):.0f} (max {max(c8j)}), bf16 median {median(c16):.0f} (max {max(c16)}); "
                f"tokens the float32 head's: {result['same_tokens']}")
        name = f"LM head argmax, {result['model']}, {batch} rows: int8 stage / bf16 pairs"
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
    print_figures(figures, "the int8 stage vs the bfloat16 pairs screen")
    write_json({"figures": figures, "result": result, "machine": where},
               results_dir(args.quick) / "int8_screen.json")
    if not args.quick and not args.no_docs:
        write_doc_block("int8-screen", "python -m benchmarks.int8_screen", figures)
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
