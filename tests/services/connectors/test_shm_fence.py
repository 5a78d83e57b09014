"""The seqlock's memory fence: a no-op on x86 (total store order), the fence built at install elsewhere, or a
refusal where that library is missing.  Nothing is compiled at run time: PATH holds no compiler here."""

from __future__ import annotations

import glob

import pytest

from services.connectors import shm_fence
from services.connectors.base import ConnectorError
from services.kernels import loader


@pytest.fixture(autouse=True)
def default_fence_after(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))   # no cc, gcc or clang to find
    loader.reset()
    yield
    loader.reset()
    shm_fence._fence = None   # the next use installs the default again, once the patches here are undone


def test_x86_needs_no_fence_instruction():
    assert shm_fence.install("auto", machine="x86_64") is shm_fence._no_fence
    assert shm_fence.kind == "none (x86 total store order)"


def test_weakly_ordered_machines_get_the_fence_built_at_install():
    for machine in ("aarch64", "ppc64le", "riscv64"):
        fence = shm_fence.install("auto", machine=machine)
        assert shm_fence.kind == "compiled" and fence is not shm_fence._no_fence
        fence()
        shm_fence.fence()
    assert loader.load("shm_fence").variant == "portable"


def test_a_missing_fence_library_means_the_shm_connector_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "FOLDER", tmp_path)   # an install without its libraries
    with pytest.raises(ConnectorError, match=r"memory fence on aarch64 .* not_built .* redis connectors"):
        shm_fence.install("auto", machine="aarch64")
    with pytest.raises(ValueError, match="unknown fence mode"):
        shm_fence.install("magic")


def test_a_store_refuses_to_start_where_it_cannot_fence(tmp_path, monkeypatch, instance):
    """The one fake here: this host is x86-64, so the architecture an aarch64 host reports is patched in."""
    from services.connectors import StoreConfig, create_store

    monkeypatch.setattr(loader, "FOLDER", tmp_path)
    monkeypatch.setattr(shm_fence.platform, "machine", lambda: "aarch64")   # FAKE: an aarch64 host
    monkeypatch.setattr(shm_fence, "_fence", None)
    with pytest.raises(ConnectorError, match="not_built"):
        create_store(StoreConfig("shm", "kv", instance, capacity_bytes=1 << 20))
    assert glob.glob(f"/dev/shm/*{instance}*") == []
