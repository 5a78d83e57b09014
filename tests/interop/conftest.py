"""The real vLLM side by side with epd: one vLLM server and one epd cluster per family.

Run with `python -m pytest -q tests/interop` (CI runs it after the main suite; the main suite does not
collect this folder: pyproject's norecursedirs).  It installs vLLM on first use
(benchmarks/peers/vllm_env.py, cached in ~/.cache/epd/peers), builds the head_dim-32 checkpoints
(vLLM's CPU attention needs head_dim >= 32) and starts, per family and once for all its tests,
`vllm serve --enable-scale-out` (which serves vLLM's render and derender routes too: the same
ServingRender as `vllm launch render`, one process less, ~1.7 GB saved) and `epd serve` on the same
checkpoint folder, so both hash with the same model id.  Families run one after the other (vLLM serve is
~4.5 GB); each is stopped before the next.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import httpx
import pytest

from benchmarks.peers.vllm_checkpoints import checkpoint_path
from benchmarks.peers.vllm_env import VLLM_VERSION, ensure_venv, start_serve
from benchmarks.procs import Server
from tests.support.cluster import RunningCluster, start_cluster

# The demo family and a second one (~5 min each on a loaded 2-core machine: one vLLM start-up, one epd
# cluster); EPD_INTEROP_FAMILIES=qwen2_vl runs one (a comma-separated list).
FAMILIES = tuple(f for f in os.environ.get("EPD_INTEROP_FAMILIES", "qwen2_vl,qwen2_5_vl").split(",") if f)
HTTP_TIMEOUT_S = 120.0  # one call; a vLLM server that dies answers at once (connection refused)
# The first test of a fresh machine installs vLLM (ensure_venv's own deadline: 30 min) and starts both
# servers (vLLM's start-up deadline: 20 min) inside its setup: pyproject's 300 s per test would cut it.
TEST_TIMEOUT_S = 3600
# Eager, as vLLM's own CPU CI runs (VLLM_CPU_CI_ENV): inductor's C++ compile costs minutes per family on a
# fresh machine (no ~/.cache/vllm) and the suite checks exactness, not speed.
VLLM_FLAGS = ("--enforce-eager",)
# The vLLM venv is the user's (~/.cache/epd/peers, shared with the benchmarks), not under the suite's own
# EPD_CACHE_DIR (the repository's .cache): one install per machine, not per checkout.  CI's HOME is empty.
os.environ.setdefault("EPD_VLLM_VENV", os.path.join(os.path.expanduser("~"), ".cache", "epd", "peers",
                                                    f"vllm-cpu-{VLLM_VERSION}"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@dataclass
class Peers:
    family: str
    model_dir: str
    vllm_render: Server
    vllm_serve: Server
    epd: RunningCluster
    http: httpx.Client

    def epd_role(self, role: str) -> str:
        return self.epd.http_urls(role)[0]

    def post(self, base: str, path: str, body: dict, **kwargs) -> httpx.Response:
        return self.http.post(base + path, json=body, **kwargs)

    def ok(self, base: str, path: str, body: dict, **kwargs) -> dict:
        reply = self.post(base, path, body, **kwargs)
        assert reply.status_code == 200, f"{base}{path}: {reply.status_code} {reply.text[:800]}"
        return reply.json()

    def stop(self) -> None:
        self.http.close()
        self.vllm_serve.stop()
        self.epd.stop()


def _start_both(model_dir: str) -> tuple[Server, RunningCluster]:
    """vLLM and epd at once (vLLM's start-up is the long one); both stopped if either fails."""
    started: dict[str, object] = {}
    errors: list[BaseException] = []

    def run_vllm() -> None:
        try:
            # epd names the model by its folder, vLLM by its --model argument: vLLM answers to both names.
            started["vllm"] = start_serve(model_dir, *VLLM_FLAGS, "--served-model-name", model_dir,
                                          os.path.basename(model_dir))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other side stopped
            errors.append(exc)

    thread = threading.Thread(target=run_vllm, daemon=True)  # an interrupted run exits; atexit stops vLLM
    thread.start()
    try:
        started["epd"] = start_cluster("--model", model_dir, timeout=900)   # 4096: the checkpoint says so
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    try:
        thread.join()
    except BaseException:  # interrupted while vLLM starts: stop epd now (atexit stops vLLM)
        if "epd" in started:
            started["epd"].stop()  # type: ignore[attr-defined]
        raise
    if errors:
        for server in started.values():
            server.stop()  # type: ignore[attr-defined]
        raise errors[0]
    return started["vllm"], started["epd"]  # type: ignore[return-value]


@pytest.fixture(scope="session", params=FAMILIES)
def peers(request) -> Peers:
    ensure_venv()
    model_dir = str(checkpoint_path(request.param))
    vllm, epd = _start_both(model_dir)
    both = Peers(request.param, model_dir, vllm, vllm, epd, httpx.Client(timeout=HTTP_TIMEOUT_S))
    yield both
    both.stop()
