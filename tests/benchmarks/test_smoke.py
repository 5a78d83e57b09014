"""The benchmark scripts run end to end in their --quick mode, so they cannot rot.

Quick mode is the tiny demo model and a few requests: it checks that every figure is
measured (servers start, both sides see the same prompt, counters move), not that a target
is met — those figures come from the full runs recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.common import RESULTS_ENV, ROOT, Figure, markdown_table, replace_block

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """This run's own results folder: concurrent runs of the suite never share one."""
    return tmp_path_factory.mktemp("bench-results")


def _run(module: str, results, *args: str, timeout: float = 200) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), RESULTS_ENV: str(results)}
    proc = subprocess.run([sys.executable, "-m", module, "--quick", *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def test_targets_quick_measures_every_figure(results):
    _run("benchmarks.targets", results, "--no-docs")
    doc = json.loads((results / "targets_quick.json").read_text())
    figures = {f["name"]: f for f in doc["figures"]}
    assert len(figures) == 9, sorted(figures)
    missing = [name for name, f in figures.items() if f["value"] is None]
    assert not missing, missing
    side = json.loads((results / "vs_transformers_serve_quick.json").read_text())["bench"]
    probe = side["side_by_side"]["probe"]["image"]
    assert probe["epd_prompt_tokens"] == probe["peer_prompt_tokens"]   # the peer saw the image


def test_side_by_side_table_renders_from_the_quick_run(results):
    from benchmarks.vs_transformers_serve import SideBySide, markdown

    path = results / "vs_transformers_serve_quick.json"
    if not path.exists():
        pytest.skip("needs test_targets_quick_measures_every_figure's output")
    doc = json.loads(path.read_text())["bench"]
    text = markdown(doc, SideBySide.quick(), doc["side_by_side"]["probe"], "python -m benchmarks.vs_transformers_serve")
    assert "| 4 |" in text and "prompt_tokens" in text


def test_capacity_quick_plans_and_gpu_example(results):
    _run("benchmarks.capacity", results)
    doc = json.loads((results / "capacity_quick.json").read_text())
    assert doc["plans"] and all(min(p["instances"].values()) >= 1 for p in doc["plans"])
    assert doc["gpu_example"]["plans"]


def test_replace_block_keeps_the_rest_of_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nintro\n")
    replace_block(page, "figures", markdown_table([Figure("a", 2.0, 3.0)]))
    replace_block(page, "figures", markdown_table([Figure("a", 4.0, 3.0)]))
    text = page.read_text()
    assert text.startswith("# Title\n\nintro\n") and text.count("figures:begin") == 1
    assert "4.00x" in text and "met" in text and "2.00x" not in text
