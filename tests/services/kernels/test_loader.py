"""services/kernels: every kernel this CPU can run is loaded from the libraries built at install, with the best
variant its features allow; masking features picks the next variant; EPD_KERNELS_OFF turns a kernel off; files
others may write, or files that are missing, are never loaded; nothing is compiled at run time."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.kernels import cpu, loader, spec
from tests.support.kernel_variants import mask_for, only_variant, runnable

ROOT = Path(__file__).resolve().parents[3]
PAIRS = [(name, variant) for name in spec.KERNELS for variant in runnable(name)]


@pytest.fixture(autouse=True)
def fresh_decisions():
    loader.reset()
    yield
    loader.reset()


@pytest.mark.parametrize("name", sorted(spec.KERNELS))
def test_every_kernel_runs_the_best_variant_this_cpu_has(name):
    """Fails (never skips) where the host has a variant's features and that variant is not loaded."""
    best = loader.expected(name)
    got = loader.load(name)
    if best:
        assert got.variant == best and got.ok, f"{name}: expected {best}, got {got.variant} ({got.reason})"
        assert Path(got.library._name).parent == loader.FOLDER   # the package's own file, nothing else
    else:
        assert got.variant == "unsupported" and not got.ok


@pytest.mark.parametrize(("name", "variant"), PAIRS)
def test_masking_the_better_variants_features_loads_each_variant(monkeypatch, name, variant):
    with only_variant(monkeypatch, name, variant):
        assert sample(name, variant) == 1.0


def test_masking_every_feature_leaves_the_portable_variants_or_torchs_path(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "all")
    for name, kernel in spec.KERNELS.items():
        expected = "portable" if "portable" in kernel.variants else "unsupported"
        assert loader.load(name).variant == expected, name
    assert mask_for("panel", "avx2") == "avx512bw,avx512dq,avx512f,avx512vl"


def test_kernels_off_names_kernels_and_families(monkeypatch):
    monkeypatch.setenv(loader.ENV_OFF, "panel,resize")
    assert {loader.load(n).variant for n in ("panel", "panel_bf16", "resize")} == {"off"}
    assert loader.load("shm_fence").variant == "portable"
    with pytest.raises(OSError, match="kernel panel: off"):
        loader.library("panel")
    with pytest.raises(ValueError, match="unknown kernel 'nope'; known: "):
        loader.load("nope")


def test_a_library_others_may_write_or_a_strangers_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o755)
    built = loader.path_of("shm_fence", "portable")
    copy = folder / built.name
    shutil.copy2(built, copy)
    monkeypatch.setattr(loader, "FOLDER", folder)
    copy.chmod(0o775)
    got = loader.load("shm_fence")
    assert got.variant == "refused" and "writable by users other than its owner" in got.reason
    copy.chmod(0o755)
    folder.chmod(0o777)
    loader.reset()
    assert loader.load("shm_fence").variant == "refused"
    folder.chmod(0o755)
    loader.reset()
    assert loader.load("shm_fence").variant == "portable"
    if os.geteuid() == 0:
        os.chown(copy, 12345, 12345)
        loader.reset()
        assert "belongs to uid 12345" in loader.load("shm_fence").reason


def test_a_missing_library_is_not_built_and_said_loudly(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loader, "FOLDER", tmp_path)
    got = loader.load("shm_fence")
    assert got.variant == "not_built" and "reinstall epd" in got.reason
    assert sample("shm_fence", "not_built") == 1.0
    assert any(r.levelname == "WARNING" and "shm_fence" in r.getMessage() for r in caplog.records)


def test_the_role_report_names_each_kernel_and_its_variant(caplog):
    caplog.set_level("INFO", logger="services.kernels.loader")
    text = loader.report("decode")
    assert text == ", ".join(f"{n} {loader.load(n).variant}" for n in loader.ROLE_KERNELS["decode"])
    assert any(r.getMessage().startswith("native kernels: ") for r in caplog.records)


def test_nothing_compiles_at_run_time_and_no_flag_names_the_build_cpu():
    flags = [f for k in spec.KERNELS.values() for v in k.variants
             for f in spec.compile_flags(k, spec.VARIANTS[v], "x86_64")]
    assert "-march=native" not in flags and "-mtune=native" not in flags
    code = [p for p in (ROOT / "services").rglob("*.py")] + [ROOT / "setup.py"]
    for path in code:
        text = path.read_text()
        assert not re.search(r"march=native|\bsubprocess\b.*\bgcc\b|\"gcc\"|'gcc'", text), path


def test_portable_sources_use_no_x86_intrinsics_and_aarch64_builds_only_portable():
    for kernel in spec.KERNELS.values():
        if "portable" in kernel.variants:
            for name in (kernel.source, *kernel.includes):
                assert "immintrin.h" not in (loader.FOLDER / name).read_text(), name
    assert {v.name for _, v in spec.builds("aarch64")} == {"portable"}
    assert {k.name for k, _ in spec.builds("aarch64")} == {k.name for k in spec.KERNELS.values()
                                                           if "portable" in k.variants}


def test_openmp_kernels_share_torchs_runtime():
    """One libgomp in the process: the kernels bind to the copy torch loaded (no second thread pool)."""
    script = ("import torch\nfrom services.kernels import loader, spec\n"
              "[loader.load(n) for n, k in spec.KERNELS.items() if k.openmp]\n"
              "maps = open('/proc/self/maps').read().split('\\n')\n"
              "print(sorted({line.split()[-1] for line in maps if 'libgomp' in line}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    gomps = eval(out.stdout.strip().splitlines()[-1])   # noqa: S307 - our own print of a list of paths
    assert len(gomps) == 1 and "torch" in gomps[0], out.stdout + out.stderr


def sample(name: str, variant: str) -> float | None:
    return REGISTRY.get_sample_value("epd_kernel_info", {"kernel": name, "variant": variant})


def test_kernels_off_is_a_checked_setting_that_roles_export_to_the_loader(monkeypatch):
    from services.config import ConfigError, EpdConfig

    with pytest.raises(ConfigError, match=r"kernels_off names unknown kernels \['nope'\]; known: fused_step"):
        EpdConfig.of(kernels_off="panel,nope")
    config = EpdConfig.of(kernels_off="fused_step", cpu_features_off="avx512f")
    monkeypatch.setenv(loader.ENV_OFF, "")
    monkeypatch.setenv(cpu.ENV, "")
    loader.configure(config.engines.kernels_off, config.engines.cpu_features_off)   # as role_main does first
    assert loader.load("fused_step").variant == "off"
    assert loader.load("panel").variant == (loader.expected("panel") or "unsupported")
    assert "avx512" not in loader.load("panel").variant


def test_deployment_docs_carry_the_generated_what_runs_where_table():
    from services.kernels import check

    text = (ROOT / "docs" / "deployment.md").read_text()
    block = text.split(f"<!-- {check.DOC_BLOCK}:begin -->\n")[1].split(f"\n<!-- {check.DOC_BLOCK}:end -->")[0]
    assert block == check.markdown(), "rerun: python -m services.kernels.check --markdown"


def test_check_says_what_runs_and_fails_where_a_kernel_is_missing(tmp_path, monkeypatch, capsys):
    from services.kernels import check

    assert check.main(["--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out
    monkeypatch.setattr(loader, "FOLDER", tmp_path)
    loader.reset()
    assert check.main([]) == 1
    assert "not_built   <- expected portable" in capsys.readouterr().out
