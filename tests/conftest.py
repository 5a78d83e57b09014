"""Session-wide test setup: a repo-local model cache and a real Redis server."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("EPD_CACHE_DIR", os.path.join(ROOT, ".cache", "epd"))


@pytest.fixture(scope="session")
def redis_server():
    from tests.support.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def demo_model_path():
    from services.models.demo import demo_model_path as build

    return build("tiny")
