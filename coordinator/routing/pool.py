"""A pool of instances of one role, with live load and health.

Instances come from flags (`--encode-urls`, ...: kept for the life of the
process) or announce themselves (`POST /v1/instances`: forgotten once they
have failed their probes for `forget_after_s`).  Each instance owns one gRPC
channel.  A failed call marks the instance down at once (passive health);
a background probe (gRPC health protocol, every PROBE_INTERVAL_S) marks a
healthy instance down when its port refuses, or after PROBE_MISSES_TO_DOWN
slow answers, and brings a down one back when it answers SERVING (active
health).  Routing policies pick among healthy instances by live in-flight
calls (`begin`/`end`, or `track`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.protocol.errors import Unavailable
from services.rpc.fastlane_client import close_stub, with_fast_lane
from services.server import GRPC_OPTIONS

from .policies import Policy, create_policy

log = logging.getLogger(__name__)
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0
PROBE_MISSES_TO_DOWN = 3   # slow (not refused) probes in a row before a healthy instance is taken out
# Keepalive finds a peer that vanished without closing its sockets (node loss); a killed process is seen
# at once anyway (its kernel resets the connections).  Short reconnect backoff: a restarted instance on the
# same address is readmitted within a probe or two instead of after grpc's default backoff (up to 120 s).
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class Instance:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: Any
    healthy: bool = True
    inflight: int = 0
    failures: int = 0
    http_url: str = ""
    registered: bool = False        # announced through POST /v1/instances (not from flags)
    down_since: float | None = None
    probe_misses: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"role": self.role, "grpc_address": self.address, "http_url": self.http_url or None,
                "healthy": self.healthy, "inflight": self.inflight,
                "source": "registered" if self.registered else "config"}


class InstancePool:
    def __init__(self, role: str, addresses: list[str], stub_factory: Callable[[grpc.aio.Channel], Any],
                 policy: str = "least_loaded", http_urls: list[str] | None = None, metrics: Any = None,
                 forget_after_s: float = 30.0, credentials: grpc.ChannelCredentials | None = None,
                 channel_options: list[tuple[str, Any]] | None = None, fast_lane: bool = False) -> None:
        self.role = role
        self.fast_lane = fast_lane  # same-host calls over the role's Unix socket (services/rpc/fastlane.py)
        self._credentials = credentials  # TLS for every channel of this pool (services.grpc_tls), or plaintext
        self._options = [*CHANNEL_OPTIONS, *(channel_options or [])]
        self.policy: Policy = create_policy(policy)
        self.metrics = metrics
        self.forget_after_s = forget_after_s
        self._stub_factory = stub_factory
        urls = http_urls or []
        self.instances: list[Instance] = []
        for index, address in enumerate(addresses):
            self.add(address, urls[index] if index < len(urls) else "", registered=False)
        self._probe_task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()   # removed instances' channels, closing after their grace

    # ---- membership ---------------------------------------------------------------------------

    def find(self, address: str) -> Instance | None:
        return next((i for i in self.instances if i.address == address), None)

    def add(self, address: str, http_url: str = "", registered: bool = True) -> Instance:
        """Add (or refresh) an instance.  A newly announced one starts down: the next probe admits it."""
        known = self.find(address)
        if known is not None:
            known.http_url = http_url or known.http_url
            return known
        channel = (grpc.aio.secure_channel(address, self._credentials, options=self._options)
                   if self._credentials is not None else grpc.aio.insecure_channel(address, options=self._options))
        stub = with_fast_lane(self._stub_factory(channel), address, self._credentials is not None, self.fast_lane)
        instance = Instance(self.role, address, channel, stub, healthy=not registered, http_url=http_url,
                            registered=registered)
        if registered:
            instance.down_since = time.monotonic()
        self.instances.append(instance)
        self._gauge(instance)
        log.info("%s %s added (%s)", self.role, address, "registered" if registered else "configured")
        return instance

    def remove(self, address: str, reason: str) -> bool:
        instance = self.find(address)
        if instance is None:
            return False
        self.instances.remove(instance)
        if self.metrics is not None:
            self.metrics.forget_instance(self.role, address)
        log.warning("%s %s removed: %s", self.role, address, reason)
        # Calls still running on it finish (or hit their deadline) before the channel closes; the closing tasks are
        # the pool's (held until done: a task nobody references can be collected mid-way).
        for closing in (instance.channel.close(grace=30.0), close_stub(instance.stub, grace_s=30.0)):
            task = asyncio.get_running_loop().create_task(closing)
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return True

    # ---- routing ------------------------------------------------------------------------------

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def pick(self, key: str | None = None, exclude: set[str] | None = None) -> Instance:
        candidates = [i for i in self.healthy() if not exclude or i.address not in exclude]
        if not candidates:
            raise Unavailable(self._none_left_message(exclude), code=f"{self.role}_unavailable")
        return self.policy.choose(candidates, key)

    def _none_left_message(self, exclude: set[str] | None) -> str:
        if not self.instances:
            return f"no {self.role} instance is configured or registered"
        down = sum(not i.healthy for i in self.instances)
        tried = len(exclude or ())
        return (f"no healthy {self.role} instance can take the call ({len(self.instances)} known, {down} down, "
                f"{tried} tried for this request)")

    def begin(self, instance: Instance) -> None:
        instance.inflight += 1

    def end(self, instance: Instance) -> None:
        instance.inflight -= 1

    @contextlib.contextmanager
    def track(self, instance: Instance) -> Iterator[Instance]:
        self.begin(instance)
        try:
            yield instance
        finally:
            self.end(instance)

    # ---- health -------------------------------------------------------------------------------

    def mark_down(self, instance: Instance, reason: str) -> None:
        if instance.healthy:
            log.warning("%s %s marked down: %s", self.role, instance.address, reason)
            instance.down_since = time.monotonic()
        instance.healthy = False
        instance.failures += 1
        self._gauge(instance)

    def _mark_up(self, instance: Instance) -> None:
        if not instance.healthy:
            log.info("%s %s back in service", self.role, instance.address)
        instance.healthy, instance.down_since, instance.probe_misses = True, None, 0
        self._gauge(instance)

    def _gauge(self, instance: Instance) -> None:
        if self.metrics is not None:
            self.metrics.instance_healthy.labels(self.role, instance.address).set(1 if instance.healthy else 0)

    def start_probing(self) -> None:
        if self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(self._probe(i) for i in list(self.instances)))
            self._forget_dead()

    async def _probe(self, instance: Instance) -> None:
        try:
            reply = await health_pb2_grpc.HealthStub(instance.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self._probe_failed(instance, exc.code())
            return
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            self._mark_up(instance)
        else:  # NOT_SERVING: draining for shutdown
            self.mark_down(instance, "health probe: not serving")

    def _probe_failed(self, instance: Instance, code: grpc.StatusCode) -> None:
        if not instance.healthy:
            return
        instance.probe_misses += 1
        # A refused or reset connection means the process is gone; a slow answer may be a busy one.
        if code != grpc.StatusCode.DEADLINE_EXCEEDED or instance.probe_misses >= PROBE_MISSES_TO_DOWN:
            self.mark_down(instance, f"health probe: {code.name}")

    def _forget_dead(self) -> None:
        now = time.monotonic()
        for i in list(self.instances):
            if i.registered and not i.healthy and i.down_since is not None \
                    and now - i.down_since > self.forget_after_s:
                self.remove(i.address, f"failed its probes for {self.forget_after_s:g} s")

    async def check_all(self, timeout: float = PROBE_TIMEOUT_S) -> dict[str, bool]:
        """Probe every instance now (used by /ready and /cluster).  An answer counts for routing too, so a
        200 from /ready means the next request is routed to what answered SERVING (not half a probe interval
        later); a failed call is left to the background probe's miss counting."""
        async def one(i: Instance) -> bool:
            try:
                reply = await health_pb2_grpc.HealthStub(i.channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.aio.AioRpcError:
                return False
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if i in self.instances:  # not removed while the probe was in flight
                if serving:
                    self._mark_up(i)
                else:
                    self.mark_down(i, "health probe: not serving")
            return serving
        instances = list(self.instances)
        results = await asyncio.gather(*(one(i) for i in instances))
        return {i.address: ok for i, ok in zip(instances, results, strict=True)}

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        for i in self.instances:
            await close_stub(i.stub)
            await i.channel.close(grace=None)
