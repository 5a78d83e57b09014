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


def test_call_seconds_integrate_the_calls_in_flight(monkeypatch):
    """Two calls at once for 2 s, then one for 1 s: 5 call-seconds (what coordinator/capacity.py reads)."""
    clock = [100.0]
    monkeypatch.setattr("coordinator.routing.pool.time.monotonic", lambda: clock[0])

    async def run():
        pool = InstancePool("encode", ["127.0.0.1:1", "127.0.0.1:2"], rpc.EncodeServiceStub)
        a, b = pool.instances
        pool.begin(a)
        pool.begin(b)
        clock[0] += 2.0
        pool.end(a)
        clock[0] += 1.0
        seconds = pool.call_seconds()
        pool.end(b)
        clock[0] += 5.0   # nothing in flight: nothing accrues
        await pool.close()
        return seconds, pool.call_seconds()

    assert asyncio.run(run()) == (5.0, 5.0)


def test_another_hosts_instance_is_remote_and_pings_every_second():
    from coordinator.routing.pool import REMOTE_KEEPALIVE, is_remote

    assert is_remote("10.0.0.7:50051") and is_remote("[fd00::7]:50051") and is_remote("epd-decode-0:50054")
    assert not is_remote("127.0.0.1:50051") and not is_remote("[::1]:50051") and not is_remote("localhost:1")
    assert dict(REMOTE_KEEPALIVE)["grpc.keepalive_time_ms"] == 1000


def test_an_unanswered_probe_takes_another_hosts_instance_out_while_its_role_has_another():
    """A cut-off host answers nothing: one probe past REMOTE_PROBE_TIMEOUT_S takes it out, unless it is the role's
    last healthy instance (then misses count, as for a busy local one)."""
    async def run():
        pool = InstancePool("decode", ["10.213.250.2:1", "10.213.250.3:1", "127.0.0.1:1"], rpc.DecodeServiceStub)
        first, second, local = pool.instances
        pool._probe_failed(first, grpc.StatusCode.DEADLINE_EXCEEDED)
        pool._probe_failed(local, grpc.StatusCode.DEADLINE_EXCEEDED)
        after_one = (first.healthy, second.healthy, local.healthy)
        pool.mark_down(local, "test")
        pool._probe_failed(second, grpc.StatusCode.DEADLINE_EXCEEDED)   # the last healthy one: stays
        last = second.healthy
        await pool.close()
        return after_one, last

    assert asyncio.run(run()) == ((False, True, True), True)
