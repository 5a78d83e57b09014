"""bfloat16 (and float16) against float32 GEMMs on this CPU: should decode or prefill offer `--dtype bfloat16`?

The shapes are the decode and prefill matmuls of SmolLM2-135M (hidden 576, MLP 1536, vocab 49152)
and of the medium demo (hidden 1024, MLP 2816, vocab 151936), at the rows a decode step (1, 16)
and a prefill chunk (256; not for the LM heads, which prefill runs on the last token only) multiply.
Candidates, all on weights made once, alternating every round:

- fp32 `F.linear` (MKL), the plain default;
- fp32 prepacked (oneDNN, services/models/prepack.py), what the roles run;
- bf16 and fp16 `F.linear`;
- bf16 and fp16 prepacked, where oneDNN accepts to pack them on this CPU (it needs avx512bw/vl/dq
  or avx_ne_convert for bf16, avx512_fp16 or avx_ne_convert for fp16; the reason is printed);
- fp32 panel and bf16 panel (services/models/panel_linear.py: float32 input and arithmetic over float32 or
  bfloat16 panels, what decode runs for `--dtype float32` / `bfloat16`), where the kernel builds.

The figure per shape is time(fp32 best) / time(bf16 best): above 1 bfloat16 would be faster.

    python -m benchmarks.bf16_gemm [--quick] [--threads T]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Figure, machine, print_figures, results_dir, write_doc_block, write_json

# (name, out_features, in_features)
SHAPES = [("smollm2 qkvo", 576, 576), ("smollm2 mlp up", 1536, 576), ("smollm2 mlp down", 576, 1536),
          ("smollm2 lm head", 49152, 576), ("medium mlp up", 2816, 1024), ("medium lm head", 151936, 1024)]
QUICK_SHAPES = SHAPES[:2]


def _candidates(out_features: int, in_features: int, rows: int) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    import torch
    import torch.nn.functional as F

    from services.models.prepack import pack_weight

    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    x = torch.randn(rows, in_features, generator=gen)
    found: dict[str, Callable[[], Any]] = {}
    refused: dict[str, str] = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        w, xd = weight.to(dtype), x.to(dtype)
        found[f"{name} F.linear"] = lambda w=w, xd=xd: F.linear(xd, w)
        try:
            packed = pack_weight(w)
            torch.ops.mkldnn._linear_pointwise(xd, packed, None, "none", [], "")
            found[f"{name} prepacked"] = lambda p=packed, xd=xd: torch.ops.mkldnn._linear_pointwise(
                xd, p, None, "none", [], "")
        except RuntimeError as exc:
            refused[f"{name} prepacked"] = str(exc).splitlines()[0][:160]
    from torch import nn

    from services.models import panel_linear

    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        if panel_linear.available(dtype):
            panel = panel_linear.PanelLinear(linear, dtype)
            found[f"{name} panel"] = lambda p=panel: p(x)
        else:
            refused[f"{name} panel"] = panel_linear.unavailable_reason()[:160]
    return found, refused


def measure(out_features: int, in_features: int, rows: int, rounds: int) -> dict[str, Any]:
    import torch

    found, refused = _candidates(out_features, in_features, rows)
    best = {name: float("inf") for name in found}
    with torch.inference_mode():
        for fn in found.values():
            fn()
        for _ in range(rounds):
            for name, fn in found.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return {"best_ms": best, "refused": refused}


def run(quick: bool = False, threads: int = 0, rounds: int | None = None) -> list[Figure]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    rounds = rounds or (3 if quick else 15)
    where = machine()
    figures, raw = [], []
    for label, out_features, in_features in QUICK_SHAPES if quick else SHAPES:
        for rows in (1, 16) if quick or "head" in label else (1, 16, 256):
            r = measure(out_features, in_features, rows, rounds)
            raw.append({"shape": label, "out": out_features, "in": in_features, "rows": rows, **r})
            best = r["best_ms"]
            fp32 = min(v for k, v in best.items() if k.startswith("fp32"))
            low = min(v for k, v in best.items() if k.startswith("bf16"))
            note = ", ".join(f"{k} {v:.3f} ms" for k, v in best.items())
            figures.append(Figure(f"fp32 best / bf16 best, {label} {out_features}x{in_features}, {rows} rows",
                                  fp32 / low, None, detail={"measured": {"time": where["time"], "loadavg":
                                                            where["loadavg_at_start"]}, **r}, note=note))
    refused = raw[0]["refused"] if raw else {}
    write_json({"machine": where, "threads": torch.get_num_threads(), "results": raw, "refused": refused},
               results_dir(quick) / f"bf16_gemm{'_quick' if quick else ''}.json")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=0)
    args = parser.parse_args(argv)
    figures = run(args.quick, args.threads, args.rounds or None)
    refused = figures[0].detail["refused"] if figures else {}
    extra = ("oneDNN refused to pack on this CPU: " + "; ".join(f"{k}: {v}" for k, v in refused.items())
             if refused else "")
    if not args.quick:
        import torch

        command = " ".join(["python -m benchmarks.bf16_gemm", *(sys.argv[1:] if argv is None else argv)])
        write_doc_block("bf16-gemm", command, figures,
                        extra=f"torch threads: {torch.get_num_threads()}; CPU capability "
                              f"{torch.backends.cpu.get_cpu_capability()}. {extra}")
    print_figures(figures, "bf16 vs fp32 GEMMs")
    if extra:
        print(extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
