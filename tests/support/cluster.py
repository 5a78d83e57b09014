"""Start a real `epd serve` cluster for end-to-end tests and stop it cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY = re.compile(r"^epd ready: (\S+)")
ROLE = re.compile(r"(render|encode|prefill|decode) http://([\d.:]+) grpc ([\d.:]+)")
ADMIN = re.compile(r"admin (http://[\d.:]+)")


@dataclass
class RunningCluster:
    process: subprocess.Popen
    url: str
    roles: list[tuple[str, str, str]] = field(default_factory=list)  # (role, http_url, grpc_address)
    admin_url: str = ""  # the coordinator's admin API (registration, aborts)
    output: list[str] = field(default_factory=list)

    def http_urls(self, role: str) -> list[str]:
        return [f"http://{h}" for r, h, _ in self.roles if r == role]

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def metrics(self, role: str, index: int = 0) -> str:
        return httpx.get(self.http_urls(role)[index] + "/metrics", timeout=10).text

    def terminate(self) -> None:
        """SIGTERM without waiting (`stop` waits): several clusters then drain at once."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        self.terminate()
        return self.process.wait(timeout=timeout)


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of samples of `name` (optionally with a label substring) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            metric = head.split("{")[0]
            if metric == name and labels in head:
                total += float(value)
    return total


def start_cluster(*flags: str, env: dict[str, str] | None = None, timeout: float = 240.0,
                  python: str = sys.executable, cwd: str = ROOT, whole_env: dict[str, str] | None = None
                  ) -> RunningCluster:
    """`epd serve` from this tree; `python`, `cwd` and `whole_env` (instead of this environment plus
    PYTHONPATH) run another install of epd instead (tests/deploy/test_docker_install.py)."""
    from services.runtime.server import free_port

    port = free_port()
    cmd = [python, "-m", "services.runtime.cli", "serve", "--port", str(port), *flags]
    # the tree first, then what the caller's PYTHONPATH adds (scripts/gpu_check.sh carries wheels that way)
    full_env = whole_env if whole_env is not None else {
        **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    cluster = RunningCluster(proc, url="")
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            cluster.output.append(line)
            match = READY.match(line)
            if match:
                cluster.url = match.group(1)
                cluster.roles = ROLE.findall(line)
                admin = ADMIN.search(line)
                cluster.admin_url = admin.group(1) if admin else ""
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError("cluster did not start:\n" + "".join(cluster.output[-60:]))
    return cluster
