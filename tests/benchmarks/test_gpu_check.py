"""scripts/gpu_check.sh --dry-run: the GPU check's own code, run here on CPU, so its first GPU run has its best chance.

The whole script (its sections in their processes, their time limits, the merge into one JSON) at small sizes;
the JSON must carry every figure the GPU run will (values here mean nothing: CPU, eager flex), say it is a dry
run, and turn into the docs block.  The cluster section starts a real cluster: tests/e2e covers that path on CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from benchmarks.common import ROOT

FIGURES = ["greedy tokens identical to generate: CUDA decode step (families x dtypes x prompts)",
           "greedy tokens identical to generate: every role, CUDA IPC connectors",
           "CUDA IPC read / device-to-device copy", "decode tok/s at 16 streams / generate batch 16 (medium)",
           "decode tok/s at 1 stream / generate batch 1 (medium)",
           "decode tok/s at 64 streams / generate batch 64 (medium)",
           "host syncs per decode step beyond the tokens' read-back", "TTFT at c=1, text (ms)",
           "TTFT at c=1, one image (ms)"]


def test_the_dry_run_writes_one_json_with_every_figure_and_a_docs_block(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_RESULTS": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=280, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for section in ("env", "ipc", "exactness", "decode"):
        assert f"gpu_check: {section} exited 0" in done.stdout, done.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["dry_run"] is True and doc["device"].startswith("CPU") and doc["errors"] == {"cluster": "not run"}
    assert [f["name"] for f in doc["figures"]] == FIGURES
    exact = doc["sections"]["exactness"]
    assert exact["identical"] == exact["total"] == 2 and not exact["errors"]   # the CUDA step's code, exact here
    assert doc["sections"]["ipc"]["rows"][0]["checksum_ok"] is True
    decode = doc["sections"]["decode"]
    assert set(decode["ratio"]) == {"1", "2"} and decode["syncs"]["steps"] > 0
    block_doc = tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", block_doc)
    body = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "docs", "--json",
                           str(tmp_path / "gpu_check.json"), "--doc", str(block_doc)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert body.startswith("DRY RUN on CPU, not a GPU result") and "| CUDA IPC read / device-to-device copy |" in body
    text = block_doc.read_text()
    assert text.count("<!-- gpu-check:begin -->") == 1 and body.strip() in text
