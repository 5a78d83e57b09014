"""Fixtures for the connector tests: a real redis-server, unique instance ids, stores closed after use."""

from __future__ import annotations

import glob
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from services.connectors import StoreConfig, TensorStore, create_store
from tests.support.redis_server import RedisServer as RedisProcess


@pytest.fixture(scope="session")
def redis_proc() -> Iterator[RedisProcess]:
    server = RedisProcess().start()
    yield server
    server.cleanup()


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    """A server of the test's own, free to be killed and restarted."""
    server = RedisProcess().start()
    yield server
    server.cleanup()


@pytest.fixture
def instance() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_store(instance: str, redis_proc: RedisProcess) -> Iterator[Callable[..., TensorStore]]:
    """Build stores of one test (unique instance ids); close them all and check nothing is left."""
    stores: list[TensorStore] = []

    def make(backend: str, purpose: str = "ec", suffix: str = "", **overrides) -> TensorStore:
        overrides.setdefault("capacity_bytes", 4 << 20)
        if backend == "redis":
            overrides.setdefault("redis_url", redis_proc.url)
            overrides.setdefault("namespace", instance)  # keys of this test only
        store = create_store(StoreConfig(backend, purpose, instance + suffix, **overrides))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
    assert glob.glob(f"/dev/shm/*{instance}*") == []
    assert redis.Redis.from_url(redis_proc.url).keys(f"{instance}:*") == []
