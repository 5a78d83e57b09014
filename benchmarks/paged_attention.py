"""Decode attention candidates on this CPU: which one the paged engine uses, by numbers.

One decode step's attention for one layer (medium model shapes: 16 query heads, 4 kv heads,
head_dim 64), 16 rows of mixed lengths, KV in a block pool of 16-token blocks:

- "c": the compiled C kernel over the blocks (services/kernels/paged_attention.c);
- "torch": rows grouped by block count, blocks gathered, one SDPA per group;
- "padded": the pre-paging way — every row padded to the longest, one SDPA with a mask over
  rows x longest (the KV already contiguous: the cost the old slot cache paid);
- "flex" (--with-flex): torch flex_attention with a block mask over the flattened pool; needs
  torch.compile on CPU (minutes of compile on 2 cores).

Candidates alternate in every round; the figure is the median per-call time, and each is
reported as a ratio to "padded" measured in the same run.  The outputs are checked against a
per-row SDPA reference (max abs diff printed).

    python -m benchmarks.paged_attention [--quick] [--with-flex]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json

HEADS, KV_HEADS, DIM, BLOCK = 16, 4, 64, 16


def _setup(lengths: list[int]) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    counts = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(counts) + 8
    k, v = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM), torch.randn(num_blocks, KV_HEADS, BLOCK, DIM)
    order = torch.randperm(num_blocks).tolist()          # blocks scattered over the pool, as in serving
    tables = torch.zeros(len(lengths), max(counts), dtype=torch.int32)
    used = 0
    for row, count in enumerate(counts):
        tables[row, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
    longest = max(lengths)
    padded_k = torch.randn(len(lengths), KV_HEADS, longest, DIM)
    padded_v = torch.randn(len(lengths), KV_HEADS, longest, DIM)
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    return {"q": torch.randn(len(lengths), HEADS, DIM), "k": k, "v": v, "tables": tables,
            "lens": torch.tensor(lengths, dtype=torch.int32), "counts": counts, "padded_k": padded_k,
            "padded_v": padded_v, "mask": mask}


def _reference(s: dict[str, Any]) -> Any:
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    rows = []
    for row, length in enumerate(s["lens"].tolist()):
        ids = s["tables"][row, :s["counts"][row]].long()
        keys = s["k"][ids].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM)[:, :length]
        values = s["v"][ids].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM)[:, :length]
        rows.append(sdpa(s["q"][row:row + 1, :, None], keys[None], values[None], enable_gqa=True)[0, :, 0])
    return torch.stack(rows)


def candidates(s: dict[str, Any], with_flex: bool) -> dict[str, Callable[[], Any]]:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from services.decode.attention import CPagedAttention, TorchPagedAttention

    scale = DIM ** -0.5
    torch_path = TorchPagedAttention()
    found: dict[str, Callable[[], Any]] = {
        "torch": lambda: torch_path(s["q"], s["k"], s["v"], s["tables"], s["lens"], scale, s["counts"]),
        "padded": lambda: sdpa(s["q"][:, :, None], s["padded_k"], s["padded_v"], attn_mask=s["mask"][:, None, None],
                               scale=scale, enable_gqa=True)[:, :, 0],
    }
    try:
        c_path = CPagedAttention()
        found["c"] = lambda: c_path(s["q"], s["k"], s["v"], s["tables"], s["lens"], scale)
    except OSError as exc:
        print(f"c kernel unavailable: {exc}")
    if with_flex:
        found["flex"] = _flex(s, scale)
    return found


def _flex(s: dict[str, Any], scale: float) -> Callable[[], Any]:
    """flex_attention over the pool flattened to one sequence, a block mask per row's blocks."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pool_tokens = s["k"].shape[0] * BLOCK
    owner = torch.full((pool_tokens,), -1, dtype=torch.int32)
    position = torch.zeros(pool_tokens, dtype=torch.int32)
    for row, count in enumerate(s["counts"]):
        for index, block in enumerate(s["tables"][row, :count].tolist()):
            owner[block * BLOCK:(block + 1) * BLOCK] = row
            position[block * BLOCK:(block + 1) * BLOCK] = torch.arange(index * BLOCK, (index + 1) * BLOCK)
    lens = s["lens"]

    def mask_mod(b, h, q_idx, kv_idx):
        return (owner[kv_idx] == q_idx) & (position[kv_idx] < lens[q_idx])

    block_mask = create_block_mask(mask_mod, 1, 1, len(lens), pool_tokens, device="cpu")
    keys = s["k"].permute(1, 0, 2, 3).reshape(1, KV_HEADS, pool_tokens, DIM)
    values = s["v"].permute(1, 0, 2, 3).reshape(1, KV_HEADS, pool_tokens, DIM)
    compiled = torch.compile(flex_attention)
    query = s["q"].permute(1, 0, 2)[None]

    def call() -> Any:
        out = compiled(query, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0].permute(1, 0, 2)

    return call


def measure(lengths: list[int], rounds: int, with_flex: bool) -> dict[str, dict[str, float]]:
    import torch

    s = _setup(lengths)
    reference = _reference(s)
    found = candidates(s, with_flex)
    times: dict[str, list[float]] = {name: [] for name in found}
    diffs = {}
    for name, fn in found.items():
        if name != "padded":
            diffs[name] = float((fn() - reference).abs().max())
    for r in range(rounds):
        names = list(found) if r % 2 == 0 else list(found)[::-1]
        for name in names:
            start = time.perf_counter()
            found[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    del torch
    return {name: {"ms": median(t), "max_abs_diff": diffs.get(name, float("nan"))} for name, t in times.items()}


def run(quick: bool = False, with_flex: bool = False) -> list[Figure]:
    random.seed(7)
    lengths = [random.randint(32, 512 if quick else 2048) for _ in range(16)]
    result = measure(lengths, 3 if quick else 15, with_flex)
    padded = result["padded"]["ms"]
    note = f"16 rows, sum of lengths {sum(lengths)}, rows x longest {16 * max(lengths)}"
    figures = [Figure(f"decode attention, {name} vs padded SDPA (time ratio)", r["ms"] / padded, None, "le",
                      detail={**r, "lengths": lengths}, note=f"{r['ms']:.2f} vs {padded:.2f} ms; {note}")
               for name, r in result.items() if name != "padded"]
    write_json({"machine": machine(), "lengths": lengths, "results": result, "figures": figures},
               results_dir(quick) / f"paged_attention{'_quick' if quick else ''}.json")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--with-flex", action="store_true", help="also time flex_attention (compiles for minutes)")
    args = parser.parse_args(argv)
    figures = run(args.quick, args.with_flex)
    if not args.quick:
        command = " ".join(["python -m benchmarks.paged_attention", *(sys.argv[1:] if argv is None else argv)])
        write_doc_block("decode-attention", command, figures)
    print_figures(figures, "paged decode attention")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
