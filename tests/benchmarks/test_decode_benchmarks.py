"""The decode engine's benchmark scripts run in --quick mode; what they assert is memory and correctness,
not speed (timings are the scripts' job)."""

from __future__ import annotations

import math


def test_kv_memory_quick_holds_tokens_within_one_block_per_stream():
    from benchmarks import kv_memory

    (figure,) = kv_memory.run(quick=True)
    detail = figure.detail
    assert figure.passed and 1.0 <= figure.value <= 1.1
    streams = len(detail["prompt_lens"])
    assert detail["at"]["blocks"] * 16 <= detail["at"]["tokens"] + 16 * streams


def test_linear_kernels_quick_times_every_kernel_and_they_agree():
    from benchmarks import linear_kernels

    figures = linear_kernels.run(quick=True)
    assert len(figures) == 4        # tiny model, batches 1 and 4, the step and the linears alone
    for f in figures:
        assert math.isfinite(f.value) and f.value > 0, f.name
        assert f.detail["same_tokens"], f.name
        assert set(f.detail["median_ms"]) == {"default", "prepacked", "panel"}


def test_fused_step_quick_times_both_modes_and_they_agree():
    from benchmarks import fused_step

    figures = fused_step.run(quick=True)
    assert len(figures) == 4        # tiny model, 1 and 4 rows, 1 and 2 threads
    for f in figures:
        assert math.isfinite(f.value) and f.value > 0, f.name
        assert f.detail["same_tokens"], f.name
        assert len(f.detail["eager_ms"]) == len(f.detail["fused_ms"]) == 3
