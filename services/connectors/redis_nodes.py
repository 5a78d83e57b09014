"""Where a redis store's key lives: one Redis server, or the master of the key's hash slot in a Redis Cluster.

`--redis-url redis://host:6379/0` is one server.  `redis+cluster://host1:7000,host2:7001` is a Redis Cluster
(any of its masters; the others are found with CLUSTER SLOTS, on first use, so a store can be built before the
cluster answers).  An entry is one Redis string (redis_format): its header, checksum and payload live in one slot,
on one node, written in one MULTI/EXEC and read with pipelined GETRANGEs on that node; entries spread over the
slots by their keys.  (A hash tag would only be needed to keep several keys of one entry together; an entry has
one key.)

Losing a node: a call that cannot reach a node's connection marks the node down in this process for
NODE_RETRY_S and raises `NodeDown`; the store turns a read of an entry there into a typed miss (EntryMissing: the
coordinator encodes or prefills again) and writes elsewhere: `place(rkey)` gives the key itself, or, while its
node is down, the first of `<key>#1` .. `<key>#N` whose slot is on a node that is up, so a put still lands and
the handle names where (readers follow the handle; lookups ask `place` too).  The cluster must keep serving the
slots of the others (`cluster-require-full-coverage no`, or replicas).  A MOVED or ASK reply (slots moved, a
replica promoted) reloads the slot map and the call is tried once more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.connectors.base import BackendUnavailable
from services.connectors.redis_errors import classify
from services.connectors.redis_resp import RespError

T = TypeVar("T")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
NODE_RETRY_S = 5.0     # a node that failed is not written to for this long (then tried again)
ALTERNATES = 16        # keys tried past a down node's: 1 - (1/3)^16 of them land elsewhere on 3 nodes
CONNECT_S, OPERATION_S = 2.0, 10.0


class NodeDown(BackendUnavailable):
    """A Redis Cluster node did not answer; the store reads its entries as missing and writes elsewhere."""


class Moved(BackendUnavailable):
    """The slot map changed under a call (MOVED / ASK): reloaded, try again."""


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def cluster_addresses(url: str) -> list[tuple[str, int]]:
    """host:port pairs of a redis+cluster:// URL (the netloc is a comma-separated list)."""
    netloc = urlsplit(url).netloc.rsplit("@", 1)[-1]
    pairs = []
    for part in filter(None, netloc.split(",")):
        host, _, port = part.rpartition(":") if not part.endswith("]") else ("", "", "")
        pairs.append((host.strip("[]"), int(port)) if host else (part.strip("[]"), 6379))
    if not pairs:
        raise ValueError(f"a Redis Cluster URL lists host:port pairs, got {url!r}")
    return pairs


def credentials(url: str) -> dict[str, Any]:
    """username / password of a redis+cluster:// URL (every node takes the same), and TLS for rediss+cluster."""
    parts = urlsplit(url)
    return {"username": parts.username or None, "password": parts.password or None,
            "ssl": parts.scheme.startswith("rediss")}


def ping_problem(url: str, timeout_s: float) -> str | None:
    """None when the store's Redis answers PING (a cluster: any of its listed nodes), else why not."""
    once: dict[str, Any] = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s,
                            "retry": Retry(NoBackoff(), 0)}
    targets = ([redis.Redis(host=h, port=p, **once, **credentials(url)) for h, p in cluster_addresses(url)]
               if is_cluster(url) else [redis.Redis.from_url(url, **once)])
    problem = None
    for client in targets:
        try:
            client.ping()
            return None
        except (redis.RedisError, OSError) as exc:
            problem = str(exc).splitlines()[0][:100]
        finally:
            client.close()
    return problem


class OneServer:
    """Every key on one server: its errors are the backend's (BackendUnavailable when it is down)."""

    cluster = False

    def __init__(self, url: str) -> None:
        # One immediate retry re-dials a pooled connection that a server restart broke; no backoff sleeps.
        self._client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_S, socket_timeout=OPERATION_S,
                                            retry=Retry(NoBackoff(), 1))
        self.where = url.rsplit("@", 1)[-1]  # never a password in a message

    def place(self, rkey: str) -> str:
        return rkey

    def call(self, rkey: str, what: str, fn: Callable[[redis.Redis], T]) -> T:
        try:
            return fn(self._client)
        except (redis.RedisError, RespError, OSError) as exc:
            raise classify(exc, self.where, what) from None

    def delete(self, rkeys: list[str]) -> None:
        for i in range(0, len(rkeys), 512):
            batch = rkeys[i:i + 512]
            self.call(batch[0], "delete", lambda client: client.delete(*batch))  # noqa: B023 - called at once

    def close(self) -> None:
        self._client.close()


class ClusterNodes:
    """The masters of a Redis Cluster, each key on its slot's, with this process's view of which are down."""

    cluster = True

    def __init__(self, url: str) -> None:
        self.url, self.where = url, url.rsplit("@", 1)[-1]
        self._cluster: Any = None
        self._down: dict[str, float] = {}   # node "host:port" -> until when it is skipped for writes
        self._lock = threading.Lock()

    def _topology(self) -> Any:
        with self._lock:
            if self._cluster is None:
                from redis.cluster import ClusterNode, RedisCluster

                try:
                    self._cluster = RedisCluster(
                        startup_nodes=[ClusterNode(h, p) for h, p in cluster_addresses(self.url)],
                        require_full_coverage=False, socket_connect_timeout=CONNECT_S,
                        socket_timeout=OPERATION_S, retry=Retry(NoBackoff(), 0), **credentials(self.url))
                except (redis.RedisError, OSError) as exc:
                    raise BackendUnavailable(f"Redis Cluster at {self.where} unavailable: {exc}") from None
            return self._cluster

    def _node(self, rkey: str) -> tuple[redis.Redis, str]:
        cluster = self._topology()
        node = cluster.get_node_from_key(rkey)
        return cluster.get_redis_connection(node), node.name

    def _is_down(self, name: str) -> bool:
        until = self._down.get(name)
        return until is not None and time.monotonic() < until

    def place(self, rkey: str) -> str:
        """`rkey`, or while its node is down the first alternate key whose node is up."""
        for candidate in [rkey, *(f"{rkey}#{n}" for n in range(1, ALTERNATES + 1))]:
            if not self._is_down(self._node(candidate)[1]):
                return candidate
        return rkey

    def call(self, rkey: str, what: str, fn: Callable[[redis.Redis], T]) -> T:
        client, name = self._node(rkey)
        try:
            return fn(client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._down[name] = time.monotonic() + NODE_RETRY_S
            raise NodeDown(f"Redis Cluster node {name} unavailable during {what}: {exc}") from None
        except (redis.RedisError, RespError) as exc:
            if str(exc).startswith(("MOVED", "ASK")):
                with self._lock:
                    self._cluster.nodes_manager.initialize()
                raise Moved(f"Redis Cluster slots moved during {what}: {exc}") from None
            raise classify(exc, name, what) from None

    def delete(self, rkeys: list[str]) -> None:
        """Each key on its own node (a multi-key DEL must not span slots); nodes that are down are skipped."""
        for rkey in rkeys:
            try:
                self.call(rkey, "delete", lambda client: client.delete(rkey))  # noqa: B023 - called at once
            except (NodeDown, Moved):
                continue

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()


def open_nodes(url: str) -> OneServer | ClusterNodes:
    return ClusterNodes(url) if is_cluster(url) else OneServer(url)


def retried(attempts: Iterable[int], fn: Callable[[int], T]) -> T:
    """`fn(attempt)` again after a Moved or NodeDown (another node may now take it), the last one raised."""
    last: BackendUnavailable | None = None
    for attempt in attempts:
        try:
            return fn(attempt)
        except (Moved, NodeDown) as exc:
            last = exc
    assert last is not None
    raise last
