"""An epd cluster spread over hosts (network namespaces, tests/support/netns.py), as a deployment across machines.

One host each for the coordinator, render, two encode, one prefill, two decode and Redis.  They reach each other
only over TCP: the coordinator calls the roles over gRPC with mutual TLS (one test CA; the roles' certificate
names `epd-roles`, which the coordinator checks instead of the dialled address), embeddings and KV travel
through the Redis host (the redis connectors; render's processed images too: the mm store follows the EC
connector), and every role announces itself to the coordinator's admin API (--coordinator-url, with the admin
token), so an instance that was cut off and forgotten joins again by itself.  Every process writes its log to
a file under `logs`, shown when a start fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.certs import make_tls_files
from tests.support.cluster import ROOT
from tests.support.netns import Hosts
from tests.support.redis_server import redis_binary

ROLE_HOSTS = {"render": ["render"], "encode": ["encode0", "encode1"], "prefill": ["prefill"],
              "decode": ["decode0", "decode1"]}
HOSTS = ["coordinator", *[h for hosts in ROLE_HOSTS.values() for h in hosts], "redis"]
GRPC_PORT, HTTP_PORT, PUBLIC_PORT, ADMIN_PORT, REDIS_PORT = 50051, 8001, 8000, 8081, 6379
ADMIN_TOKEN = "epd-multihost-admin"
SERVER_NAME = "epd-roles"
# Roles share this machine's cores here: one engine thread each keeps seven model processes from oversubscribing.
ROLE_FLAGS = ("--role-threads", "1", "--max-model-len", "2048", "--ec-capacity-mb", "64", "--kv-capacity-mb", "64")


@dataclass
class MultiHostCluster:
    hosts: Hosts
    folder: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    extra: tuple[str, ...] = ()

    # ---- addresses ------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.hosts.ip('coordinator')}:{PUBLIC_PORT}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.hosts.ip('coordinator')}:{ADMIN_PORT}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.hosts.ip('redis')}:{REDIS_PORT}/0"

    def http_url(self, host: str) -> str:
        return f"http://{self.hosts.ip(host)}:{HTTP_PORT}"

    def grpc_address(self, host: str) -> str:
        return f"{self.hosts.ip(host)}:{GRPC_PORT}"

    def role_of(self, host: str) -> str:
        return next(role for role, hosts in ROLE_HOSTS.items() if host in hosts)

    # ---- processes ------------------------------------------------------------------------------------------

    def _tls(self) -> list[str]:
        return ["--grpc-tls-cert", str(self.folder / "cert.pem"), "--grpc-tls-key", str(self.folder / "key.pem"),
                "--grpc-tls-ca", str(self.folder / "ca.pem")]

    def _common(self) -> list[str]:
        return ["--ec-connector", "redis", "--kv-connector", "redis", "--redis-url", self.redis_url, *self._tls()]

    def _run(self, host: str, command: list[str]) -> subprocess.Popen:
        log = open(self.folder / "logs" / f"{host}.log", "ab")  # noqa: SIM115 - the process owns it from here
        env = {**os.environ, "PYTHONPATH": ROOT}
        process = self.hosts.popen(host, command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.processes[host] = process
        return process

    def start_redis(self) -> None:
        ip = self.hosts.ip("redis")
        self._run("redis", [redis_binary(), "--port", str(REDIS_PORT), "--bind", ip, "--save", "", "--appendonly",
                            "no", "--protected-mode", "no", "--dir", str(self.folder)])

    def start_coordinator(self) -> None:
        ip = self.hosts.ip("coordinator")
        self._run("coordinator", [
            sys.executable, "-m", "services.runtime.cli", "coordinator", "--host", ip, "--port", str(PUBLIC_PORT),
            "--admin-host", ip, "--admin-port", str(ADMIN_PORT), "--admin-token", ADMIN_TOKEN,
            "--grpc-tls-server-name", SERVER_NAME, "--instance-forget-after-s", "2", *self._common(), *self.extra])

    def start_role(self, host: str) -> None:
        role, ip = self.role_of(host), self.hosts.ip(host)
        self._run(host, [
            sys.executable, "-m", "services.runtime.cli", role, "--host", ip, "--grpc-port", str(GRPC_PORT),
            "--http-port", str(HTTP_PORT), "--instance-id", host, "--coordinator-url", self.admin_url,
            "--admin-token", ADMIN_TOKEN, "--openai-render-urls", self.http_url("render"), *ROLE_FLAGS,
            *self._common()])

    def kill(self, host: str) -> float:
        """SIGKILL what `host` runs (a crash); the monotonic time it happened."""
        process = self.processes[host]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        return time.monotonic()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until the coordinator has every instance ready (each announced and probed SERVING)."""
        want = {role: len(hosts) for role, hosts in ROLE_HOSTS.items()}
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            self._check_running()
            with contextlib.suppress(httpx.HTTPError):
                last = httpx.get(self.url + "/ready", timeout=5).json()
                if last.get("ready_instances") == want:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the multi-host cluster was not ready in {timeout:g} s: {last}\n{self.tail()}")

    def _check_running(self) -> None:
        dead = [h for h, p in self.processes.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited during start-up\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        out = []
        for host in self.processes:
            path = self.folder / "logs" / f"{host}.log"
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            out.append(f"--- {host}\n" + "\n".join(text))
        return "\n".join(out)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every process (roles drain, delete their Redis keys, say goodbye), then the hosts go."""
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.hosts.close()


def start_multihost(extra: tuple[str, ...] = (), timeout: float = 300.0) -> MultiHostCluster:
    """Hosts, certificates, Redis, the coordinator and every role; ready, or everything torn down and raised."""
    hosts = Hosts(HOSTS).start()
    folder = Path(tempfile.mkdtemp(prefix="epd-multihost-"))
    (folder / "logs").mkdir()
    cluster = MultiHostCluster(hosts, folder, extra=extra)
    try:
        make_tls_files(folder, names=("localhost", SERVER_NAME))
        cluster.start_redis()
        cluster.start_coordinator()
        for hosts_of_role in ROLE_HOSTS.values():
            for host in hosts_of_role:
                cluster.start_role(host)
        cluster.wait_ready(timeout)
    except BaseException:
        cluster.stop(grace=5.0)
        raise
    return cluster
