"""One cluster per tiny model family, shared by the e2e modules that serve that family with the same flags.

tests/e2e/test_model_families.py and tests/e2e/test_video.py both serve Qwen2.5-VL and Qwen3-VL on shm with
the same flags; each cluster start costs the suite ~15 s on 2 cores.  A module names the cluster it wants by
a key, (family, device): `cluster(module, key)` starts it on the first ask, and `release(module, key)` stops
it once every module that needs it is done.  Who needs what comes from the collected tests (each module's
`family_key(params)` of a test's parameters; tests/e2e/conftest.py), so a `-k` run shares only what it runs.
Every check these modules make reads what its own requests did (token ids, counter deltas), never what
another module's left behind.  tests/e2e/conftest.py runs test_video.py right after test_model_families.py,
so a cluster kept for the later module never idles beside the other modules' clusters.
"""

from __future__ import annotations

from collections import defaultdict

from tests.support.cluster import RunningCluster, start_cluster

Key = tuple[str, str]   # (family, device)


def family_flags(key: Key) -> tuple[str, ...]:
    """A family's cluster: up to two images (or an image and a video) per request."""
    from services.models.tiny import tiny_model_path

    family, device = key
    return ("--model", str(tiny_model_path(family)), "--ec-capacity-mb", "32", "--kv-capacity-mb", "32",
            "--decode-slots", "4", "--max-images-per-request", "2", "--device", device)


class FamilyClusters:
    def __init__(self) -> None:
        self.running: dict[Key, RunningCluster] = {}
        self.users: dict[Key, set[str]] = defaultdict(set)   # the modules still to use each cluster
        self.stopped: list[RunningCluster] = []   # terminated, to be waited for (tests/e2e/conftest.py)

    def need(self, module: str, key: Key) -> None:
        self.users[key].add(module)

    def cluster(self, module: str, key: Key) -> RunningCluster:
        self.users[key].add(module)
        if key not in self.running:
            # a loaded 2-core machine: the first start compiles decode
            self.running[key] = start_cluster(*family_flags(key), timeout=600)
        return self.running[key]

    def release(self, module: str, key: Key) -> None:
        self.users[key].discard(module)
        if not self.users[key] and key in self.running:
            self._stop(key)

    def stop_all(self) -> None:
        for key in list(self.running):
            self._stop(key)

    def _stop(self, key: Key) -> None:
        cluster = self.running.pop(key)
        cluster.terminate()   # its drain overlaps the next start-up; waited for with the package's clusters
        self.stopped.append(cluster)
