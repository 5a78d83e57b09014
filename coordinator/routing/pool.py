"""A pool of instances of one role, with live load and health.

Each instance owns one gRPC channel.  A failed call marks the instance down
at once (passive health); a background probe (gRPC health protocol) brings it
back (active health).  Routing policies pick among healthy instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.protocol.errors import Unavailable
from services.server import GRPC_OPTIONS

from .policies import Policy, create_policy

log = logging.getLogger(__name__)
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0


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
    extra: dict[str, Any] = field(default_factory=dict)


class InstancePool:
    def __init__(self, role: str, addresses: list[str], stub_factory: Callable[[grpc.aio.Channel], Any],
                 policy: str = "least_loaded") -> None:
        if not addresses:
            raise ValueError(f"no {role} instances configured")
        self.role = role
        self.policy: Policy = create_policy(policy)
        self._stub_factory = stub_factory
        self.instances = [self._connect(a) for a in addresses]
        self._probe_task: asyncio.Task | None = None

    def _connect(self, address: str) -> Instance:
        channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return Instance(self.role, address, channel, self._stub_factory(channel))

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def pick(self, key: str | None = None, exclude: set[str] | None = None) -> Instance:
        candidates = [i for i in self.healthy() if not exclude or i.address not in exclude]
        if not candidates:
            raise Unavailable(f"no healthy {self.role} instance", code=f"{self.role}_unavailable")
        return self.policy.choose(candidates, key)

    @contextlib.contextmanager
    def track(self, instance: Instance) -> Iterator[Instance]:
        instance.inflight += 1
        try:
            yield instance
        finally:
            instance.inflight -= 1

    def mark_down(self, instance: Instance, reason: str) -> None:
        if instance.healthy:
            log.warning("%s %s marked down: %s", self.role, instance.address, reason)
        instance.healthy = False
        instance.failures += 1

    def start_probing(self) -> None:
        if self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(self._probe(i) for i in self.instances if not i.healthy))

    async def _probe(self, instance: Instance) -> None:
        stub = health_pb2_grpc.HealthStub(instance.channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            log.info("%s %s back in service", self.role, instance.address)
            instance.healthy = True

    async def check_all(self, timeout: float = PROBE_TIMEOUT_S) -> dict[str, bool]:
        """Probe every instance now (used by /health and /cluster)."""
        async def one(i: Instance) -> bool:
            try:
                reply = await health_pb2_grpc.HealthStub(i.channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                return False
        results = await asyncio.gather(*(one(i) for i in self.instances))
        return {i.address: ok for i, ok in zip(self.instances, results, strict=True)}

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        for i in self.instances:
            await i.channel.close(grace=None)
