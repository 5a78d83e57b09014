"""proto/: `buf lint` passes with proto/buf.yaml, and the breaking-change rules it configures work: they
accept the contract against itself, catch a deleted RPC, and (once a release is tagged v*) hold the
working tree to the last released contract, as docs/deployment.md describes."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .manifests import ROOT, tool

PROTO = ROOT / "proto"


def buf(*args: str, cwd=PROTO, tmp_cache=None) -> subprocess.CompletedProcess:
    binary = tool("buf")
    if binary is None:
        pytest.fail("buf not found: install the test extras (buf-bin)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_cache), "BUF_CACHE_DIR": str(tmp_cache)}
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60, env=env)


def test_buf_lint_passes(tmp_path):
    out = buf("lint", tmp_cache=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_breaking_rules_accept_the_same_contract_and_catch_a_deleted_rpc(tmp_path):
    assert buf("breaking", "--against", ".", tmp_cache=tmp_path).returncode == 0
    changed = tmp_path / "proto"
    shutil.copytree(PROTO, changed)
    epd = changed / "services" / "rpc" / "v1" / "epd.proto"
    text = epd.read_text()
    assert "rpc Abort(" in text
    epd.write_text("\n".join(line for line in text.splitlines() if "rpc Abort(" not in line))
    out = buf("breaking", "--against", str(PROTO), cwd=changed, tmp_cache=tmp_path)
    assert out.returncode != 0 and "Abort" in out.stdout


def _last_release_tag() -> str | None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run([git, "describe", "--tags", "--abbrev=0", "--match", "v*"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or None


def test_no_breaking_change_since_the_last_release(tmp_path):
    tag = _last_release_tag()
    if tag is None:
        pytest.skip("no release tag v* yet: nothing released to stay compatible with")
    out = buf("breaking", "--against", f"../.git#tag={tag},subdir=proto", tmp_cache=tmp_path)
    assert out.returncode == 0, f"breaking changes since {tag}:\n{out.stdout}{out.stderr}"
