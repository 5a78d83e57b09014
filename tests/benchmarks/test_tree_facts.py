"""benchmarks/tree_facts.py counts what a reader meets: lines per file and package, at this tree and at a commit."""

from __future__ import annotations

from benchmarks import tree_facts
from benchmarks.common import ROOT


def test_lines_are_the_files_newlines_and_stubs_are_left_out():
    counted = tree_facts.lines_at(None)
    assert "services/decode/engine.py" in counted and not any("_pb2" in f for f in counted)
    assert counted["services/decode/engine.py"] == (ROOT / "services/decode/engine.py").read_bytes().count(b"\n")
    doc = tree_facts.facts()
    assert doc["lines"] == sum(counted.values()) == sum(doc["lines_per_package"].values())
    assert doc["lines_per_package"]["services/decode"] == sum(
        n for f, n in counted.items() if f.startswith("services/decode/") and f.count("/") == 2)


def test_a_commit_is_counted_from_git():
    assert tree_facts.lines_at("HEAD")["services/__init__.py"] == \
        tree_facts.lines_at(None)["services/__init__.py"]
