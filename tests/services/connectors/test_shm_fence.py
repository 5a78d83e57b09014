"""The seqlock's memory fence: a no-op on x86 (total store order), a compiled C fence elsewhere, or a refusal."""

from __future__ import annotations

import glob
import os

import pytest

from services.connectors import shm_fence
from services.connectors.base import ConnectorError


@pytest.fixture(autouse=True)
def default_fence_after():
    yield
    shm_fence.install("auto")


def test_x86_needs_no_fence_instruction():
    assert shm_fence.install("auto", machine="x86_64") is shm_fence._no_fence
    assert shm_fence.kind == "none (x86 total store order)"


def test_weakly_ordered_machines_get_the_compiled_fence(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    for machine in ("aarch64", "ppc64le", "riscv64"):
        fence = shm_fence.install("auto", machine=machine)
        assert shm_fence.kind == "compiled" and fence is not shm_fence._no_fence
        fence()
        shm_fence.fence()
    assert len(glob.glob(str(tmp_path / "shm_fence-*.so"))) == 3  # cached per machine, built once


def test_a_cached_fence_needs_no_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    shm_fence.install("compiled", machine="aarch64")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    shm_fence.install("compiled", machine="aarch64")()


def test_no_compiler_means_the_shm_connector_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConnectorError, match=r"memory fence on aarch64 .* no C compiler .* redis connectors"):
        shm_fence.install("auto", machine="aarch64")
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="unknown fence mode"):
        shm_fence.install("magic")


def test_a_store_refuses_to_start_where_it_cannot_fence(tmp_path, monkeypatch, instance):
    """The one fake here: this host is x86-64, so the architecture an aarch64 host reports is patched in."""
    from services.connectors import StoreConfig, create_store

    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(shm_fence.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(shm_fence, "_fence", None)
    with pytest.raises(ConnectorError, match="no C compiler"):
        create_store(StoreConfig("shm", "kv", instance, capacity_bytes=1 << 20))
    assert glob.glob(f"/dev/shm/*{instance}*") == []
