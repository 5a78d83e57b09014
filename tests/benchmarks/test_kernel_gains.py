"""benchmarks.kernel_gains --quick: one kernel on and off on two real tiny clusters; side B really runs without it
(its decode's epd_kernel_info says off while A's says the variant this CPU runs), both sides answer every request,
and the kept-or-deleted table renders from the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import kernel_gains
from benchmarks.common import RESULTS_ENV, ROOT
from services.kernels import loader


def test_quick_run_turns_the_kernel_off_on_side_b_only(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), RESULTS_ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.kernel_gains", "--quick", "--kernels", "fused_step"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    entry = json.loads((tmp_path / kernel_gains.JSON_NAME).read_text())["cases"]["fused_step"]
    assert entry["kernels"]["A"]["decode/fused_step"] == loader.expected("fused_step")
    assert entry["kernels"]["B"]["decode/fused_step"] == "off"
    assert entry["kernels"]["A"]["decode/panel"] == entry["kernels"]["B"]["decode/panel"]   # nothing else differs
    assert [row["failed"] for row in entry["rows"]] == [[0, 0], [0, 0]]
    assert all(row["on"] > 0 and row["off"] > 0 for row in entry["rows"])
    assert "| fused_step | the fused decode step" in done.stdout
    assert entry["levels"] == [list(level) for level in kernel_gains.QUICK_LEVELS]
