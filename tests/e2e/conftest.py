"""Real clusters for end-to-end tests: `epd serve` with shm connectors, and with Redis.

The shared clusters are package-scoped: they stop when the last test of tests/e2e is done (not at the end
of the whole run, idling beside the unit tests), all at once (`stopped_together`).  The tiny families' clusters
are shared by test_model_families.py and test_video.py and stop when the last of them is done with each
(`family_clusters`, tests/support/family_clusters.py).
"""

from __future__ import annotations

import pytest

from tests.support.cluster import start_cluster
from tests.support.family_clusters import FamilyClusters

FAMILIES = pytest.StashKey[FamilyClusters]()
FAMILY_MODULES = ("test_model_families.py", "test_video.py")   # in this order, next to each other


@pytest.hookimpl(trylast=True)   # after pytest's own ordering by fixture parameters
def pytest_collection_modifyitems(config, items):
    """test_video.py right after test_model_families.py; which module needs which family cluster."""
    families = config.stash.setdefault(FAMILIES, FamilyClusters())
    later = [item for item in items if item.path.name == FAMILY_MODULES[1] and item.path.parent.name == "e2e"]
    earlier = [i for i, item in enumerate(items) if item.path.name == FAMILY_MODULES[0]]
    if later and earlier:
        rest = [item for item in items if item not in later]
        at = rest.index(items[earlier[-1]]) + 1
        items[:] = rest[:at] + later + rest[at:]
    for item in items:
        key_of = getattr(item.module, "family_key", None)
        key = key_of(item.callspec.params) if key_of is not None and hasattr(item, "callspec") else None
        if key is not None:
            families.need(item.module.__name__, key)


@pytest.fixture(scope="package")
def family_clusters(request, stopped_together):
    families = request.config.stash.setdefault(FAMILIES, FamilyClusters())
    families.stopped = stopped_together
    yield families
    families.stop_all()


@pytest.fixture(scope="package")
def stopped_together():
    """Clusters put here get SIGTERM when their fixture ends and are waited for here, after the last one:
    their drains overlap instead of queueing."""
    clusters = []
    yield clusters
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="package")
def shm_cluster(demo_model_path, stopped_together):
    cluster = start_cluster("--max-image-bytes", "1000000", "--max-images-per-request", "4",
                            "--ec-capacity-mb", "64", "--kv-capacity-mb", "64")
    yield cluster
    cluster.terminate()
    stopped_together.append(cluster)


@pytest.fixture(scope="package")
def redis_cluster(demo_model_path, redis_server, stopped_together):
    # --lm-head-screen on: the tiny head is below auto's size, so this cluster's exactness tests are the ones
    # that run greedy tokens through the screen in prefill and decode (the shm cluster's run the full head)
    cluster = start_cluster("--ec-connector", "redis", "--kv-connector", "redis", "--redis-url", redis_server.url,
                            "--allow-private-media-urls", "--ec-capacity-mb", "64", "--kv-capacity-mb", "64",
                            "--lm-head-screen", "on")
    yield cluster
    cluster.terminate()
    stopped_together.append(cluster)


@pytest.fixture(scope="package")
def reference(demo_model_path):
    from tests.support.reference import Reference

    return Reference(demo_model_path)


class PoolCluster:
    """Two instances of each role, small queues: shared by the admission and failover tests.

    Failover tests kill instances; `intact()` gives a cluster with every instance alive, starting a fresh
    one if an earlier test damaged it (so the modules pass in any order).
    """

    FLAGS = ("--encode-instances", "2", "--prefill-instances", "2", "--decode-instances", "2",
             "--decode-slots", "4", "--decode-queue", "4", "--prefill-max-queue", "8",
             "--max-inflight-requests", "24", "--max-model-len", "1024", "--ec-capacity-mb", "1",
             "--kv-capacity-mb", "32", "--instance-forget-after-s", "2")

    def __init__(self) -> None:
        self.cluster = None
        self.damaged = False
        self.instance_id = ""

    def intact(self):
        if self.cluster is None or self.damaged or self.cluster.process.poll() is not None:
            self.stop()
            import uuid

            self.instance_id = "pool" + uuid.uuid4().hex[:6]
            self.cluster = start_cluster(*self.FLAGS, "--instance-id", self.instance_id)
            self.damaged = False
        return self.cluster

    def stop(self) -> None:
        if self.cluster is not None and self.cluster.process.poll() is None:
            self.cluster.stop()
        self.cluster = None


@pytest.fixture(scope="package")
def pool_clusters(demo_model_path):
    holder = PoolCluster()
    yield holder
    holder.stop()


# The secured cluster (tests/e2e/test_auth.py and the other security tests): two public keys from a key file
# (as a mounted Secret holds them), a separate key for the roles' HTTP APIs, an admin token and mTLS.
PUBLIC_KEYS = ("sk-epd-test-tenant-a", "sk-epd-test-tenant-b")
ROLE_KEY = "sk-epd-test-roles"
ADMIN_TOKEN = "epd-test-admin-token"
BODY_LIMIT = 8 * 1024 * 1024
BODY_READ_S = 3.0


@pytest.fixture(scope="package")
def secure_tls(tmp_path_factory):
    from tests.support.certs import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="package")
def secure_cluster(demo_model_path, tmp_path_factory, secure_tls, stopped_together):
    """Keys, admin token, and mutual TLS on every internal gRPC hop; vLLM's per-request metrics on answers; every
    process on the standard library's event loop (`--event-loop asyncio`; the other clusters run uvloop)."""
    keyfile = tmp_path_factory.mktemp("secrets") / "api-keys"
    keyfile.write_text("# one key per tenant\n" + "\n".join(PUBLIC_KEYS) + "\n")
    tls = ("--grpc-tls-cert", str(secure_tls["cert"]), "--grpc-tls-key", str(secure_tls["key"]),
           "--grpc-tls-ca", str(secure_tls["ca"]))
    cluster = start_cluster("--api-key", f"@{keyfile}", "--role-api-key", ROLE_KEY, "--admin-token", ADMIN_TOKEN,
                            *tls, "--max-request-bytes", str(BODY_LIMIT), "--body-read-timeout-s", str(BODY_READ_S),
                            "--ec-capacity-mb", "32", "--kv-capacity-mb", "32", "--enable-per-request-metrics",
                            "--event-loop", "asyncio")
    yield cluster
    cluster.terminate()
    stopped_together.append(cluster)
