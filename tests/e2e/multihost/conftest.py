"""One set of hosts for the whole package: coordinator, render, two encode, prefill, two decode and Redis, each in
its own network namespace (tests/support/multihost.py).  Started once (~45 s here), shared by every test of the
package, torn down at the end, also when a test fails (leftovers of a killed run are swept at the next start)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="package")
def multihost(demo_model_path):
    if os.geteuid() != 0:
        pytest.skip("hosts are network namespaces: creating them needs root (as in CI)")
    from tests.support.multihost import start_multihost

    cluster = start_multihost()
    try:
        yield cluster
    finally:
        cluster.stop()
