"""Fused MLPs and the GEMM patch embedding (services/models/fused_mlp.py) against the same model without them.

In one process, on the medium checkpoint, both sides on oneDNN-prepacked linears (`--linear-kernel
prepacked`), so only the fusion differs: A = as the roles load it (gated MLPs as GEMMs with SiLU and
the product as post-ops, quick_gelu in place, the patch embedding as one GEMM), B = the same linears
unfused.  Timed as a role runs them: on the process's one multi-threaded thread, every other thread
on one (services/hostcpu/compute_threads.py, set before torch loads), rounds alternating A and B:
the vision forward of one 224x224 image and the decoder stack's forward of a 150-token prompt (what
prefill runs at c=1 with one image).  Figures: time A / time B (median of per-round ratios); outputs
must agree to 1e-4 relative.  `--quick`: the tiny model, 3 rounds, docs untouched.

    python -m benchmarks.fused_mlp [--quick] [--no-docs] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Figure, print_figures, write_doc_block


def _timed(fn: Callable[[], Any], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(model: str, rounds: int, prompt: int = 150) -> list[Figure]:
    import torch

    from benchmarks.stage_costs import _noise_image
    from services.hostcpu import compute_threads
    from services.models.demo import demo_model_path
    from services.models.prepack import prepack_language, prepack_vision
    from services.models.registry import adapter_for
    from services.render.processor import ImageProcessor

    compute_threads.single()   # loading happens here, on this thread: no OpenMP team of its own
    path = demo_model_path(model)
    adapter = adapter_for(path)
    item = {k: torch.from_numpy(v) for k, v in ImageProcessor(path).process(_noise_image(224, 224)).arrays.items()}
    vision = {"A": adapter.load_vision(path, "cpu", "float32"), "B": adapter.load_vision(path, "cpu", "float32")}
    prepack_vision(vision["A"], "prepacked")
    prepack_vision(vision["B"], "prepacked", fuse=False)
    lms = {side: adapter.load_language(path, "cpu", "float32", prompt + 16) for side in "AB"}
    prepack_language(lms["A"], "prepacked", fuse=True)
    prepack_language(lms["B"], "prepacked")
    hidden = lms["A"].hidden_size
    x = torch.randn(1, prompt, hidden, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(prompt)[None, None].expand(3, 1, prompt)

    def stack(side: str) -> torch.Tensor:
        return lms[side].model(inputs_embeds=x, position_ids=positions, use_cache=False).last_hidden_state

    probes = {"vision": lambda side: vision[side].encode([item])[0], "stack": stack}
    out: dict[str, Any] = {}

    def work() -> None:
        compute_threads.enter()
        with torch.inference_mode():
            diffs = {}
            for name, probe in probes.items():
                want, got = probe("B"), probe("A")
                diffs[name] = float((got - want).abs().max() / want.abs().max())
            times: dict[str, dict[str, list[float]]] = {n: {"A": [], "B": []} for n in probes}
            for index in range(rounds):
                for name, probe in probes.items():
                    for side in ("AB" if index % 2 == 0 else "BA"):
                        times[name][side].append(_timed(lambda p=probe, s=side: p(s)))
        out.update(diffs=diffs, times=times)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    figures = []
    for name, label in (("vision", "vision forward, one 224x224 image"), ("stack", f"decoder stack, {prompt} rows")):
        a, b = out["times"][name]["A"], out["times"][name]["B"]
        value = statistics.median(x / y for x, y in zip(a, b, strict=True))
        figures.append(Figure(f"{label}, {model}, fused / unfused", value, None, "le",
                              note=f"{statistics.median(a) * 1e3:.1f} vs {statistics.median(b) * 1e3:.1f} ms "
                                   f"(medians of {rounds} rounds, best of 3 each); outputs differ by "
                                   f"{out['diffs'][name]:.1e} relative"))
        if out["diffs"][name] > 1e-4:
            raise AssertionError(f"{name}: fused and unfused outputs differ by {out['diffs'][name]:.1e}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--rounds", type=int)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if "torch" not in sys.modules:   # as role_main does: before torch loads
        from services.hostcpu import compute_threads

        compute_threads.apply(None)
    rounds = args.rounds or (3 if args.quick else 8)
    figures = measure("tiny" if args.quick else "medium", rounds)
    print_figures(figures, "fused MLPs")
    if not (args.quick or args.no_docs):
        write_doc_block("fused-mlp", " ".join(["python -m benchmarks.fused_mlp", *argv]), figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
