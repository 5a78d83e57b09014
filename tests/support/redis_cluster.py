"""A real Redis Cluster for tests: N redis-server nodes in cluster mode on loopback, slots split evenly, no replicas.

The nodes run `--cluster-require-full-coverage no` (what docs/deployment.md asks of a cluster without replicas), so
when one dies the others keep serving their slots.  Built with CLUSTER ADDSLOTS and CLUSTER MEET (redis-server 6.2,
the binary the test extra ships, has no ADDSLOTSRANGE); ready once every node reports cluster_state:ok.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

from services.runtime.server import free_port
from tests.support.redis_server import redis_binary

SLOTS = 16384
BUS_OFFSET = 10000   # a node also listens on port + 10000 (the cluster bus): both must be free, below 65536


def _node_port() -> int:
    while True:
        port = free_port()
        if port + BUS_OFFSET < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + BUS_OFFSET))
                return port
            except OSError:
                continue


class RedisClusterNodes:
    def __init__(self, count: int = 3) -> None:
        self.ports = [_node_port() for _ in range(count)]
        self.dir = tempfile.mkdtemp(prefix="epd-redis-cluster-")
        self.processes: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start_node(self, port: int) -> None:
        self.processes[port] = subprocess.Popen(
            [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "no", "--cluster-enabled", "yes", "--cluster-config-file",
             f"nodes-{port}.conf", "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=5)

    def start(self, timeout: float = 20.0) -> RedisClusterNodes:
        try:
            for port in self.ports:
                self.start_node(port)
            self._wait(lambda: all(self._pings(p) for p in self.ports), timeout, "nodes to answer")
            share = SLOTS // len(self.ports)
            for i, port in enumerate(self.ports):
                last = SLOTS if i == len(self.ports) - 1 else (i + 1) * share
                self.client(port).execute_command("CLUSTER ADDSLOTS", *range(i * share, last))
            for port in self.ports[1:]:
                self.client(self.ports[0]).execute_command("CLUSTER MEET", "127.0.0.1", port)
            self._wait(lambda: all(self._state_ok(p) for p in self.ports), timeout, "cluster_state:ok")
        except BaseException:
            self.cleanup()
            raise
        return self

    def _pings(self, port: int) -> bool:
        try:
            return bool(self.client(port).ping())
        except redis.RedisError:
            return False

    def _state_ok(self, port: int) -> bool:
        info = self.client(port).execute_command("CLUSTER INFO")   # redis-py parses it into a dict of str
        return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == len(self.ports)

    @staticmethod
    def _wait(ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.05)
        raise RuntimeError(f"the Redis Cluster did not come up ({what}) in {timeout:g} s")

    def kill(self, port: int) -> None:
        process = self.processes.pop(port)
        process.kill()
        process.wait(timeout=5)

    def keys_per_node(self, pattern: str = "epd:*") -> dict[int, int]:
        return {p: len(self.client(p).keys(pattern)) for p in self.ports if p in self.processes}

    def cleanup(self) -> None:
        for port in list(self.processes):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)
