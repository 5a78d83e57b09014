"""benchmarks/startup.py --quick: one real `epd serve` start of the tiny model, timed to its ready line."""

from __future__ import annotations

import json


def test_quick_start_writes_every_figure_of_one_timed_start(tmp_path, monkeypatch):
    from benchmarks import common, startup
    from services.models import kernel_choices

    monkeypatch.setenv(common.RESULTS_ENV, str(tmp_path))
    stale = kernel_choices.folder() / "linear-stale.json"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("{}")
    assert startup.main(["--quick"]) == 0
    # the start began with no kept kernel choices and kept the ones its roles timed
    assert not stale.exists() and any(kernel_choices.folder().glob("linear-*.json"))
    doc = json.loads((tmp_path / "startup.json").read_text())
    (run,) = doc["runs"]["demo"]["A"]
    assert set(run) == {"ready_s", "cpu_s", "first_ms", "stop_s"}
    assert 0 < run["ready_s"] < startup.READY_TIMEOUT_S and 0 < run["stop_s"] < startup.STOP_TIMEOUT_S
    assert run["cpu_s"] > run["ready_s"] / 4      # five processes loading: CPU, not waiting
    assert 0 < run["first_ms"] < 120_000
    assert [f["name"] for f in doc["figures"]] == [
        "time to ready p50, demo", "CPU to ready p50, demo", "first answer p50, demo", "stop p50, demo"]
    assert [f["value"] for f in doc["figures"]] == [run["ready_s"], run["cpu_s"], run["first_ms"], run["stop_s"]]
