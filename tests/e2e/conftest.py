"""Real clusters for end-to-end tests: `epd serve` with shm connectors, and with Redis."""

from __future__ import annotations

import pytest

from tests.support.cluster import start_cluster


@pytest.fixture(scope="session")
def shm_cluster(demo_model_path):
    cluster = start_cluster("--max-image-bytes", "1000000", "--max-images-per-request", "4",
                            "--ec-capacity-mb", "64", "--kv-capacity-mb", "64")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster(demo_model_path, redis_server):
    cluster = start_cluster("--ec-connector", "redis", "--kv-connector", "redis", "--redis-url", redis_server.url,
                            "--allow-private-media-urls", "--ec-capacity-mb", "64", "--kv-capacity-mb", "64")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def reference(demo_model_path):
    from tests.support.reference import Reference

    return Reference(demo_model_path)
