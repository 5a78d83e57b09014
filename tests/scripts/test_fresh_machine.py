"""CI is the fresh-machine run of the README's three commands: they cannot drift apart."""

from __future__ import annotations

import os

from scripts.fresh_machine import ROOT, fresh_env, printed_curl, readme_commands


def test_ci_runs_the_fresh_machine_script():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 scripts/fresh_machine.py" in ci and "pytest" not in ci.split("set -euo")[1]


def test_the_readme_block_holds_the_three_commands():
    serve, tests, interop = readme_commands(ROOT / "README.md")
    assert serve.startswith("python3 -m venv .venv && ") and serve.endswith(".venv/bin/epd serve")
    assert tests.startswith("python3 -m venv .venv && ") and tests.endswith(".venv/bin/python -m pytest -q")
    assert "'.[test]'" in tests
    assert interop == ".venv/bin/python -m pytest -q tests/interop"  # the real vLLM, its own suite


def test_the_environment_is_a_new_users(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", "/somewhere")
    monkeypatch.setenv("HF_HOME", "/hf")
    monkeypatch.setenv("PATH", f"/x/.venv/bin{os.pathsep}/usr/bin")
    env = fresh_env(tmp_path)
    assert env["HOME"] == str(tmp_path) and env["PATH"] == "/usr/bin"
    assert not [k for k in env if k.startswith(("EPD_", "HF_"))]


def test_the_curl_is_taken_from_the_serve_output():
    lines = ["epd ready: http://127.0.0.1:8000 (model m)\n", "try:\n", "curl -s http://127.0.0.1:8000/v1/x -d '{}'\n"]
    assert printed_curl(lines) == "curl -s http://127.0.0.1:8000/v1/x -d '{}'"
