"""benchmarks/common.py: a docs block names the script that wrote it, also when that script ran with `python -m`."""

from __future__ import annotations

import importlib.util

from benchmarks.common import script_module


def test_a_script_run_with_dash_m_is_named_by_its_spec_not_main():
    spec = importlib.util.find_spec("benchmarks.open_loop")
    assert script_module({"__name__": "__main__", "__spec__": spec}) == "benchmarks.open_loop"
    assert script_module({"__name__": "benchmarks.overhead"}) == "benchmarks.overhead"
    assert script_module({"__name__": "__main__", "__spec__": None}) == "__main__"   # python file.py: no spec
