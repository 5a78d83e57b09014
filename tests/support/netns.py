"""Hosts for the multi-host tests: Linux network namespaces on one bridge, reachable only over TCP (root only).

`Hosts(["coordinator", "encode0", ...])` makes, per host, a namespace `epdmh-<pid>-<host>` whose one interface
(`eth0`, plus `lo`) is a veth pair's end; the other end (`mh<pid>h<i>`) is a port of the bridge `mhb<pid>`,
which also carries the first address of a /24 no route of this machine uses yet, so the test process reaches
every host and nothing else does.  Faults, without `tc` (FACTS.md, 2026-12-06):

- `cut(host)` / `restore(host)`: the host's bridge port down / up, a clean partition of that host from all;
- `partition(a, b)` / `heal(a, b)`: blackhole routes to each other's address on both sides, so only `a` and `b`
  stop reaching each other.

Everything is named after the creating process's pid: `close()` (also on failure: call it in a `finally`) kills
what the hosts run and deletes the namespaces and the bridge; `sweep()`, run at start, removes what a process
that is gone left behind (a SIGKILLed test run), never another live run's hosts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence

PREFIX = "epdmh-"
BRIDGE_PREFIX = "mhb"
SUBNET_BASE = "10.213"


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def sweep() -> list[str]:
    """Remove the namespaces and bridges of test runs whose process is gone; return their names."""
    removed = []
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", "type", "bridge").splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        owner = name[len(BRIDGE_PREFIX):]
        if name.startswith(BRIDGE_PREFIX) and owner.isdigit() and not _alive(int(owner)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> str:
    used = _ip("-4", "route", "show", "table", "all")
    for third in range(0, 250):
        prefix = f"{SUBNET_BASE}.{third}."
        if prefix not in used:
            return prefix
    raise RuntimeError(f"no free /24 under {SUBNET_BASE}.0.0/16")


class Hosts:
    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.pid = os.getpid()
        self.bridge = f"{BRIDGE_PREFIX}{self.pid}"
        self.subnet = ""
        self.processes: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return f"{PREFIX}{self.pid}-{host}"

    def port(self, host: str) -> str:
        return f"mh{self.pid}h{self.names.index(host)}"

    def ip(self, host: str) -> str:
        return f"{self.subnet}{self.names.index(host) + 2}"

    @property
    def gateway(self) -> str:
        """The bridge's address: where the test process is seen from."""
        return f"{self.subnet}1"

    def start(self) -> Hosts:
        sweep()
        self.subnet = _free_subnet()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.names:
                self._add(host)
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, host: str) -> None:
        ns, port = self.ns(host), self.port(host)
        _ip("netns", "add", ns)
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", port, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, host: str, command: Sequence[str], **kwargs) -> subprocess.Popen:
        """`command` on `host` (its own process group, so `close` can end it and its children)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *command], start_new_session=True,
                                   **kwargs)
        self.processes.append(process)
        return process

    def cut(self, host: str) -> float:
        """Take `host` off the network (its bridge port down); the monotonic time it happened."""
        _ip("link", "set", self.port(host), "down")
        return time.monotonic()

    def restore(self, host: str) -> float:
        _ip("link", "set", self.port(host), "up")
        return time.monotonic()

    def partition(self, a: str, b: str) -> None:
        """`a` and `b` no longer reach each other; both still reach every other host."""
        _ip("-n", self.ns(a), "route", "add", "blackhole", f"{self.ip(b)}/32")
        _ip("-n", self.ns(b), "route", "add", "blackhole", f"{self.ip(a)}/32")

    def heal(self, a: str, b: str) -> None:
        _ip("-n", self.ns(a), "route", "del", "blackhole", f"{self.ip(b)}/32", check=False)
        _ip("-n", self.ns(b), "route", "del", "blackhole", f"{self.ip(a)}/32", check=False)

    def close(self) -> None:
        """Stop everything the hosts run, then delete them; safe to call twice and after a failed start."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        existing = {line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line.split()}
        for host in self.names:
            if self.ns(host) in existing:
                _kill_namespace_processes(self.ns(host))
                _ip("netns", "del", self.ns(host), check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
