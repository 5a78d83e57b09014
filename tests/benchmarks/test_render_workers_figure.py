"""benchmarks/render_workers.py's figure: the median of per-round ratios and the CPU-bound ceiling.

The script's run itself takes ~30 s on this machine (two spawned pools), too long for the suite; the
arithmetic that turns its rounds into the figure and the docs block is checked here on known rounds.
"""

from __future__ import annotations

import pytest

from benchmarks.render_workers import Round, figures


def test_figure_is_the_median_of_back_to_back_ratios_with_the_cpu_ceiling():
    one = [Round(10.0, 6.0, 1.0), Round(20.0, 6.0, 1.0), Round(40.0, 6.0, 1.0)]
    two = [Round(18.0, 6.0, 1.0), Round(30.0, 6.0, 1.0), Round(80.0, 6.0, 1.0)]  # ratios 1.8, 1.5, 2.0
    (figure,) = figures({1: one, 2: two})
    assert figure.value == pytest.approx(1.8)
    assert figure.passed is True and figure.target == 1.7
    assert figure.detail["round_ratios"] == pytest.approx([1.8, 1.5, 2.0])
    assert figure.detail["ceiling_2_idle_cores"] == pytest.approx(12.0 / 7.0)
    assert figure.detail["images_per_s_1_worker"] == 20.0 and figure.detail["images_per_s_2_workers"] == 30.0
    assert "ratio = median of per-round ratios 1.50..2.00" in figure.note
    assert "workers 6.0 ms, main process 1.0 ms, so the ceiling on 2 idle cores is 1.71x" in figure.note
