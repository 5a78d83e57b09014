"""The image runs the kernels the benchmarks measure: the Dockerfile's build-stage commands, run as written in a
fresh virtual environment (no Docker engine here), install epd with every native kernel this CPU should run;
then the installed `epd serve`, with no compiler on PATH and started away from the source tree, reports in
each role's /metrics (epd_kernel_info) the same variants as this checkout.

What differs from a real image build, and why: paths (/opt/venv, /opt/epd, /src) live in a temporary folder;
the CPU torch index is not reachable here, so TORCH_INDEX_URL points at an empty local index and the
dependencies already installed in this environment (torch included, never epd itself) are visible to the
fresh venv through a .pth file, so pip finds them satisfied instead of downloading them."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.kernels import loader
from tests.support.cluster import start_cluster

from .manifests import ROOT

DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
OWN = ("epd-", "epd.", "__editable__", "services", "coordinator", "_epd")


def build_stage(text: str) -> list[tuple[str, str]]:
    """(instruction, argument) of the stage named `build`, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            logical.append(current)
            current = ""
    steps, inside = [], False
    for line in logical:
        word, _, rest = line.partition(" ")
        if word == "FROM":
            inside = rest.strip().endswith(" AS build")
        elif inside:
            steps.append((word, rest.strip()))
    return steps


def dependency_farm(tmp: Path) -> Path:
    """This environment's installed packages, epd's own files left out, as links in one folder."""
    farm = tmp / "deps"
    farm.mkdir()
    source = Path(site.getsitepackages()[0])
    for entry in source.iterdir():
        if entry.name.startswith(OWN) or entry.suffix == ".pth":
            continue
        (farm / entry.name).symlink_to(entry)
    return farm


def run_build_stage(tmp: Path) -> tuple[Path, Path]:
    """The build stage's COPY and RUN steps, in order; returns (venv, EPD_CACHE_DIR)."""
    venv, src, epd_dir = tmp / "venv", tmp / "src", tmp / "opt-epd"
    paths = {"/opt/venv": str(venv), "/opt/epd": str(epd_dir), "/src": str(src)}

    def local(value: str) -> str:
        for image_path, here in paths.items():
            value = re.sub(rf"(?<![\w/]){re.escape(image_path)}(?=/|\b|$)", here, value)
        return value

    (tmp / "empty-index").mkdir()
    env = {**{k: v for k, v in os.environ.items() if k.startswith("PIP_") or k in ("PATH", "HOME")},
           "TORCH_INDEX_URL": (tmp / "empty-index").as_uri()}
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=120)  # type: ignore[attr-defined]
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_epd_test_dependencies.pth").write_text(f"{dependency_farm(tmp)}\n")
    # torch requires a newer setuptools than a fresh venv's; the image gets it from the torch index, here it comes
    # from the configured package index (only setuptools: torch itself is already satisfied, never downloaded).
    subprocess.run([python, "-m", "pip", "install", "-q", "setuptools>=77"], env=env, check=True, timeout=300)
    workdir = tmp
    for word, rest in build_stage(DOCKERFILE.read_text()):
        if word == "ARG":
            name, _, default = rest.partition("=")
            env.setdefault(name, default.replace("${TORCH_VARIANT}", env.get("TORCH_VARIANT", "")))
        elif word == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                env[name] = local(value).replace("$PATH", env["PATH"])
        elif word == "WORKDIR":
            workdir = Path(local(rest))
            workdir.mkdir(parents=True, exist_ok=True)
        elif word == "COPY":
            *sources, target = shlex.split(rest)
            for pattern in sources:
                for found in sorted(ROOT.glob(pattern.rstrip("*"))) if "*" in pattern else [ROOT / pattern]:
                    copy_in(found, workdir / target if target.startswith(".") else Path(local(target)))
        elif word == "RUN":
            done = subprocess.run(["bash", "-c", local(rest)], cwd=workdir, env=env, capture_output=True, text=True,
                                  timeout=1200)
            assert done.returncode == 0, f"RUN {rest}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return venv, Path(env["EPD_CACHE_DIR"])


def copy_in(found: Path, target: Path) -> None:
    """One COPY source, as the .dockerignore lets it in (no caches, no kernel libraries built in place)."""
    if found.is_dir():
        shutil.copytree(found, target / found.name if target.name != found.name else target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "_*.so"))
    elif found.exists():
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(found, target / found.name)


@pytest.mark.timeout(1500)
def test_the_images_install_steps_give_every_role_the_kernels_of_this_checkout(tmp_path):
    venv, models = run_build_stage(tmp_path)
    python = venv / "bin" / "python"
    home = tmp_path / "home"
    home.mkdir()
    # The runtime stage: PATH holds the venv and nothing else (no cc, gcc or clang), away from any source tree.
    env = {"PATH": str(venv / "bin"), "HOME": str(home), "EPD_CACHE_DIR": str(models), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1", "HF_HOME": str(tmp_path / "hf")}
    assert not any(shutil.which(cc, path=env["PATH"]) for cc in ("cc", "gcc", "clang"))
    where = subprocess.run([str(python), "-I", "-c", "import services.kernels as k; print(k.__file__)"], env=env,
                           cwd=home, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    cluster = start_cluster("--model", "demo", "--ec-capacity-mb", "32", "--kv-capacity-mb", "32", python=str(python),
                            cwd=str(home), whole_env=env, timeout=600)
    try:
        logged = [line for line in cluster.output if '"native kernels: ' in line]
        assert {role for role in loader.ROLE_KERNELS if any(f'"role": "{role}"' in line for line in logged)} == set(
            loader.ROLE_KERNELS), "every role says in its start-up log which variant of each kernel it runs"
        for role, names in loader.ROLE_KERNELS.items():
            text = httpx.get(cluster.http_urls(role)[0] + "/metrics", timeout=10).text
            got = dict(re.findall(r'^epd_kernel_info\{kernel="(\w+)",variant="(\w+)"\} 1\.0$', text, re.M))
            assert got == {name: loader.load(name).variant for name in names}, role
            assert all(loader.load(name).ok == (loader.expected(name) != "") for name in names)
    finally:
        cluster.stop(60)
