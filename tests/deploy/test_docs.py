"""The operator docs cannot drift from the code: configuration.md is generated from the settings schema,
and the metric names, EPD_* variables, deploy/ paths and cross-links the docs mention all exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.config import schema

from .manifests import ROOT

DOCS = ROOT / "docs"
OWN_DOCS = ("deployment.md", "operations.md", "configuration.md", "troubleshooting.md", "llm-d.md", "security.md")
# Variables read outside services.config: the demo model cache, the image's health check, benchmark output.
OTHER_VARIABLES = {"EPD_CACHE_DIR", "EPD_HEALTH_PORT", "EPD_BENCH_RESULTS_DIR", "EPD_BENCH_PROFILES_DIR",
                   "EPD_FAST_LANE_DIR"}


def doc(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def load_generator():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_docs
    finally:
        sys.path.pop(0)
    return gen_config_docs


def test_configuration_md_is_generated_from_the_schema():
    expected = load_generator().current()
    assert doc("configuration.md") == expected, "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_the_generator_check_mode_agrees():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_every_setting_is_in_configuration_md():
    text = doc("configuration.md")
    for entry in schema():
        assert f"`{entry['flag']}`" in text and f"`{entry['env']}`" in text


def _source() -> str:
    files = [*(ROOT / "services").rglob("*.py"), *(ROOT / "coordinator").rglob("*.py")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_metric_names_in_operations_md_exist_in_the_code():
    source = _source()
    names = set(re.findall(r"\bepd_[a-z0-9_]+", doc("operations.md")))
    assert names
    # A Counter is defined by its base name; an owner-kept count (services.observability.owned_metrics) by its
    # _total name.
    missing = sorted(n for n in names
                     if f'"{re.sub(r"_(total|bucket|sum|count)$", "", n)}"' not in source and f'"{n}"' not in source)
    assert missing == [], f"operations.md names metrics the code does not define: {missing}"


@pytest.mark.parametrize("name", OWN_DOCS)
def test_every_epd_variable_mentioned_is_a_setting(name):
    known = {entry["env"] for entry in schema()} | OTHER_VARIABLES
    mentioned = {m.rstrip("_") for m in re.findall(r"\bEPD_[A-Z][A-Z0-9_]*", doc(name))}
    assert sorted(mentioned - known) == []


@pytest.mark.parametrize("name", OWN_DOCS)
def test_deploy_paths_mentioned_exist(name):
    paths = {p.rstrip(".,:;)`'") for p in re.findall(r"(?<![\w/])deploy/(?:k8s|helm|docker)\b[\w./-]*", doc(name))}
    missing = sorted(p for p in paths if not (ROOT / p.replace("<name>", "")).exists())
    assert missing == []


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)}


@pytest.mark.parametrize("name", OWN_DOCS)
def test_links_between_these_docs_resolve(name):
    broken = []
    for target, anchor in re.findall(r"\]\(([\w.-]+\.md)?(?:#([\w-]+))?\)", doc(name)):
        path = DOCS / (target or name)
        if target and target not in OWN_DOCS:
            continue  # written elsewhere (architecture.md, protocol.md)
        if not path.exists() or (anchor and anchor not in _anchors(path)):
            broken.append(f"{target}#{anchor}")
    assert broken == []


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)(?:#[\w-]+)?\)", readme))
    assert sorted(p.name for p in DOCS.glob("*.md") if p.name not in linked) == []
    assert "epd bench" in readme


@pytest.mark.parametrize("name", ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_relative_links_stay_inside_the_repository_and_resolve(name):
    path = ROOT / name if name == "README.md" else DOCS / name
    text = path.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        resolved = (path.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(ROOT.resolve()) or not resolved.exists():
            broken.append(target)
    assert broken == []
    assert "shared/design" not in text   # the team's design notes are not part of the repository


def test_benchmarks_md_is_generated_from_the_results_json():
    """docs/benchmarks.md holds nothing typed by hand but its header: every section is a JSON a benchmark wrote."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.docpage", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
