"""Instance pools against real in-process gRPC health servers: admission, mark-down, forgetting."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from coordinator.metrics import CoordinatorMetrics
from coordinator.routing.pool import InstancePool
from services.config import ROUTING_POLICIES
from services.protocol.errors import Unavailable
from services.rpc.v1 import epd_pb2_grpc as rpc
from services.runtime.server import free_port

_METRICS = CoordinatorMetrics(CollectorRegistry())


async def _health_server(port: int) -> grpc.aio.Server:
    return (await _health_servicer(port))[0]


async def _health_servicer(port: int, status: int = health_pb2.HealthCheckResponse.SERVING
                           ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await servicer.set("", status)
    return server, servicer


async def _until(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            return float("inf")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_every_routing_policy_the_config_accepts_is_made_by_its_name():
    from coordinator.routing.policies import create_policy

    assert [type(create_policy(name)).__name__ for name in ROUTING_POLICIES] == [
        "HashAffinity", "LeastLoaded", "RoundRobin"]
    with pytest.raises(ValueError, match="unknown routing policy 'x'; supported: affinity, least_loaded"):
        create_policy("x")


def test_an_announced_instance_starts_down_and_a_probe_admits_it():
    async def run():
        port = free_port()
        server = await _health_server(port)
        pool = InstancePool("encode", [], rpc.EncodeServiceStub, metrics=_METRICS)
        pool.start_probing()
        instance = pool.add(f"127.0.0.1:{port}", "http://127.0.0.1:1")
        assert not instance.healthy and instance.registered
        admitted = await _until(lambda: instance.healthy, 5.0)
        await pool.close()
        await server.stop(None)
        return admitted
    assert asyncio.run(run()) < 1.5


def test_a_probe_made_now_counts_for_routing():
    """/ready's probes (check_all) update routing at once: what answered SERVING is picked by the next request,
    what answered NOT_SERVING is not, without waiting for the background probe (not started here)."""
    async def run():
        port = free_port()
        server, servicer = await _health_servicer(port, health_pb2.HealthCheckResponse.NOT_SERVING)
        pool = InstancePool("decode", [], rpc.DecodeServiceStub, metrics=_METRICS)
        instance = pool.add(f"127.0.0.1:{port}")
        assert await pool.check_all() == {instance.address: False}
        with pytest.raises(Unavailable):
            pool.pick()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await pool.check_all() == {instance.address: True}
        picked = pool.pick()
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await pool.check_all() == {instance.address: False}
        left = len(pool.healthy())
        await pool.close()
        await server.stop(None)
        return picked is instance, left
    assert asyncio.run(run()) == (True, 0)


def test_a_healthy_instance_whose_port_closes_is_marked_down_within_a_probe():
    async def run():
        port = free_port()
        server = await _health_server(port)
        pool = InstancePool("prefill", [f"127.0.0.1:{port}"], rpc.PrefillServiceStub, metrics=_METRICS)
        pool.start_probing()
        instance = pool.instances[0]
        await asyncio.sleep(0.7)
        assert instance.healthy
        await server.stop(None)
        down = await _until(lambda: not instance.healthy, 5.0)
        configured_kept = await _until(lambda: not pool.instances, 1.5)  # flags' instances are never forgotten
        await pool.close()
        return down, configured_kept
    down, forgotten = asyncio.run(run())
    assert down < 1.0
    assert forgotten == float("inf")


def test_a_registered_instance_that_stays_down_is_forgotten():
    async def run():
        pool = InstancePool("decode", [], rpc.DecodeServiceStub, metrics=_METRICS, forget_after_s=0.5)
        pool.start_probing()
        pool.add(f"127.0.0.1:{free_port()}")
        gone = await _until(lambda: not pool.instances, 5.0)
        await pool.close()
        return gone
    assert asyncio.run(run()) < 2.5


def test_pick_names_why_no_instance_can_take_a_call():
    async def run():
        pool = InstancePool("render", [], rpc.RenderServiceStub)
        with pytest.raises(Unavailable, match="no render instance is configured or registered"):
            pool.pick()
        instance = pool.add("127.0.0.1:1")
        with pytest.raises(Unavailable, match="1 known, 1 down") as err:
            pool.pick()
        assert err.value.code == "render_unavailable"
        pool.remove(instance.address, "test")
        await pool.close()
    asyncio.run(run())


def test_announcing_again_refreshes_instead_of_duplicating():
    async def run():
        pool = InstancePool("encode", ["127.0.0.1:5"], rpc.EncodeServiceStub, http_urls=["http://h:1"])
        again = pool.add("127.0.0.1:5", "http://h:2")
        assert len(pool.instances) == 1 and again.http_url == "http://h:2" and not again.registered
        await pool.close()
    asyncio.run(run())
