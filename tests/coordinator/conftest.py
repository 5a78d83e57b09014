"""A CoordinatorApp built once per test session: its metrics live in the process's default registry, which
takes each collector name once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def coordinator_app():
    from coordinator.app import CoordinatorApp
    from services.config import EpdConfig

    return CoordinatorApp(EpdConfig.of(render_urls="127.0.0.1:1", encode_urls="127.0.0.1:2",
                                    prefill_urls="127.0.0.1:3", decode_urls="127.0.0.1:4"))
