"""API keys on real processes: every HTTP route a process serves needs a key, except the probes.

The routes are not listed here: each process logs its route table at start
("<role> http routes: [...]"), and the test calls every one of them, so a
route added later (readiness, llm-d calls) is checked without touching this
file.  Keys must never appear in any log line, also when a wrong one is sent.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.server import PROBE_PATHS
from tests.e2e.conftest import PUBLIC_KEYS, ROLE_KEY

ROLES = ("render", "encode", "prefill", "decode")
WRONG_KEY = "sk-epd-test-not-a-key"


def logged_routes(cluster, role: str) -> list[tuple[str, str]]:
    """[method, path] pairs from the role's start-up log line."""
    marker = f"{role} http routes: "
    for line in cluster.output:
        try:
            msg = json.loads(line).get("msg", "")
        except ValueError:
            continue
        if msg.startswith(marker):
            return [tuple(pair) for pair in json.loads(msg[len(marker):])]
    raise AssertionError(f"{role} logged no route table")


def _call(url: str, method: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = b"{}" if method in ("POST", "PUT", "DELETE", "PATCH") else None
    return httpx.request(method, url, headers=headers, content=body, timeout=30)


@pytest.mark.parametrize("role", ROLES)
def test_every_role_route_but_the_probes_needs_the_role_key(secure_cluster, role):
    routes = logged_routes(secure_cluster, role)
    assert ("POST", "/inference/v1/generate") in routes or ("POST", "/v1/chat/completions/render") in routes
    base = secure_cluster.http_urls(role)[0]
    for method, path in routes:
        url = base + path.replace("{", "").replace("}", "")
        if path in PROBE_PATHS:
            assert _call(url, method, None).status_code == 200, path
            continue
        missing = _call(url, method, None)
        assert missing.status_code == 401, (method, path, missing.text)
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "missing_api_key"
        for wrong in (WRONG_KEY, PUBLIC_KEYS[0]):  # the public keys are not the roles' keys
            reply = _call(url, method, wrong)
            assert reply.status_code == 401 and reply.json() == {"error": {
                "message": f"the API key sent is not valid for the {role} HTTP API",
                "type": "invalid_request_error", "code": "invalid_api_key"}}, (method, path)
        assert _call(url, method, ROLE_KEY).status_code != 401, (method, path)


def test_the_role_key_serves_a_real_call(secure_cluster):
    url = secure_cluster.http_urls("render")[0] + "/tokenize"
    reply = httpx.post(url, json={"prompt": "hello"}, headers={"Authorization": f"Bearer {ROLE_KEY}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == [14990]


def test_grpc_health_stays_open(secure_cluster):
    for role, _, address in secure_cluster.roles:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, role


def test_keys_never_appear_in_logs(secure_cluster):
    _call(secure_cluster.http_urls("decode")[0] + "/abort_requests", "POST", WRONG_KEY)
    output = "".join(secure_cluster.output)
    assert "requires an API key" in output
    for key in (*PUBLIC_KEYS, ROLE_KEY, WRONG_KEY):
        assert key not in output


def test_without_keys_each_process_says_it_is_unauthenticated(shm_cluster):
    output = "".join(shm_cluster.output)
    for role in ROLES:
        assert f"the {role} HTTP API is unauthenticated" in output, role
