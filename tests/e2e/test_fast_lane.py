"""On one host the coordinator reaches each role over its fast lane (services/rpc/fastlane.py); with TLS, over gRPC.

Read from each role's own counter of calls it served over the fast lane (`epd_fast_lane_calls_total`), around one
image request through the real cluster: render, encode, prefill and decode each served their call there.  The
exactness and error suites run through the same clusters, so every answer and error code they check came over
the fast lane too.
"""

from __future__ import annotations

import httpx

from tests.e2e.conftest import PUBLIC_KEYS
from tests.support.cluster import metric_value
from tests.support.images import chat, noise_image

METHODS = {"render": "RenderChat", "encode": "Encode", "prefill": "Prefill", "decode": "Decode"}


def _served(cluster) -> dict[str, float]:
    return {role: metric_value(cluster.metrics(role), "epd_fast_lane_calls_total", f'method="{method}"')
            for role, method in METHODS.items()}


def test_each_role_serves_the_coordinator_over_its_fast_lane(shm_cluster):
    before = _served(shm_cluster)
    body = chat("Describe it.", [noise_image(224, 224, seed=4401)], max_tokens=3, temperature=0)
    reply = httpx.post(shm_cluster.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    after = _served(shm_cluster)
    assert {role: after[role] - before[role] for role in METHODS} == {role: 1.0 for role in METHODS}


def test_with_tls_every_hop_stays_on_grpc(secure_cluster):
    body = chat("Describe it.", [noise_image(224, 224, seed=4402)], max_tokens=2, temperature=0)
    reply = httpx.post(secure_cluster.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {PUBLIC_KEYS[0]}"})
    assert reply.status_code == 200, reply.text
    assert _served(secure_cluster) == {role: 0.0 for role in METHODS}


def test_the_sockets_live_in_a_private_folder_named_by_port_and_instance(shm_cluster):
    """Each role's socket is `rpc-<grpc port>-<instance id>.sock` in this user's 0700 folder, and only this user's
    processes hold it open."""
    import os
    import stat

    from services.rpc import fastlane

    folder = fastlane.socket_dir()
    info = os.lstat(folder)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    ports = {int(grpc.rsplit(":", 1)[1]) for _, _, grpc in shm_cluster.roles}
    for port in ports:
        [path] = fastlane.sockets_for(port)
        assert path.name.startswith(f"rpc-{port}-") and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
