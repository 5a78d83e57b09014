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

from services.runtime.announce import _send as announce
from services.runtime.server import PROBE_PATHS
from tests.e2e.conftest import ADMIN_TOKEN, PUBLIC_KEYS, ROLE_KEY

ROLES = ("render", "encode", "prefill", "decode")
WRONG_KEY = "sk-epd-test-not-a-key"


ADMIN_ROUTES = [("POST", "/v1/instances"), ("DELETE", "/v1/instances"), ("GET", "/v1/instances"),
                ("POST", "/update_weights"), ("POST", "/reload_weights"), ("GET", "/weights"),
                ("POST", "/abort_requests")]


def logged_routes(cluster, role: str, kind: str = "http") -> list[tuple[str, str]]:
    """[method, path] pairs from the process's start-up log line ("<role> <kind> routes: [...]")."""
    marker = f"{role} {kind} routes: "
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


def test_every_coordinator_route_but_the_probes_needs_an_api_key(secure_cluster):
    routes = logged_routes(secure_cluster, "coordinator")
    assert ("POST", "/v1/chat/completions") in routes and ("POST", "/inference/v1/generate") in routes
    for method, path in routes:
        url = secure_cluster.url + path
        if path in PROBE_PATHS:
            assert _call(url, method, None).status_code == 200, path
            continue
        missing = _call(url, method, None)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key", (method, path)
        for wrong in (WRONG_KEY, ROLE_KEY, ADMIN_TOKEN):  # neither the roles' key nor the admin token opens it
            reply = _call(url, method, wrong)
            assert reply.status_code == 401 and reply.json()["error"] == {
                "message": "the API key sent is not valid for the coordinator API",
                "type": "invalid_request_error", "code": "invalid_api_key"}, (method, path)
        for key in PUBLIC_KEYS:
            assert _call(url, method, key).status_code != 401, (method, path)


def test_both_api_keys_serve_chat(secure_cluster):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key in PUBLIC_KEYS:
        reply = httpx.post(secure_cluster.url + "/v1/chat/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text


def test_the_public_port_has_no_control_routes(secure_cluster):
    assert set(ADMIN_ROUTES).isdisjoint(logged_routes(secure_cluster, "coordinator"))
    for method, path in ADMIN_ROUTES:
        reply = _call(secure_cluster.url + path, method, PUBLIC_KEYS[0])
        assert reply.status_code == 404, (method, path, reply.text)
        assert reply.json()["error"] == {"message": f"no route {method} {path} on this port",
                                         "type": "not_found_error", "code": "route_not_found"}


def test_the_admin_api_needs_the_admin_token(secure_cluster):
    admin = secure_cluster.admin_url
    assert admin.startswith("http://127.0.0.1:") and admin != secure_cluster.url
    assert logged_routes(secure_cluster, "coordinator", "admin") == ADMIN_ROUTES
    for method, path in ADMIN_ROUTES:
        missing = _call(admin + path, method, None)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_admin_token", path
        for wrong in (WRONG_KEY, ROLE_KEY):
            assert _call(admin + path, method, wrong).json()["error"]["code"] == "invalid_admin_token", path
        assert _call(admin + path, method, ADMIN_TOKEN).status_code not in (401, 403), path
    # A tenant's API key may abort (its own requests, test_request_ids.py) but not touch the pools.
    for method, path in ADMIN_ROUTES:
        reply = _call(admin + path, method, PUBLIC_KEYS[0])
        if path == "/abort_requests":
            assert reply.status_code == 400  # the body {} names no ids: the key itself was accepted
        else:
            assert reply.status_code == 403 and reply.json()["error"]["code"] == "admin_token_required", path
    listed = httpx.get(admin + "/v1/instances", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert {i["role"] for i in listed.json()["data"]} == set(ROLES)


def test_a_role_announces_itself_with_the_admin_token(secure_cluster):
    """The announcer's request against the real admin API: with the token it registers, without it is refused."""
    body = {"role": "encode", "grpc_address": "127.0.0.1:9", "http_url": "http://127.0.0.1:9"}
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def registered() -> bool:
        listed = httpx.get(secure_cluster.admin_url + "/v1/instances", headers=headers, timeout=10).json()["data"]
        return any(i["grpc_address"] == "127.0.0.1:9" for i in listed)

    with pytest.raises(OSError, match="401"):
        announce(secure_cluster.admin_url, "POST", body)
    assert not registered()
    assert announce(secure_cluster.admin_url, "POST", body, ADMIN_TOKEN) == 200
    assert registered()
    assert announce(secure_cluster.admin_url, "DELETE", {"role": "encode", "grpc_address": "127.0.0.1:9"},
                    ADMIN_TOKEN) == 200
    assert not registered()


def test_the_role_key_serves_a_real_call(secure_cluster):
    url = secure_cluster.http_urls("render")[0] + "/tokenize"
    reply = httpx.post(url, json={"prompt": "hello"}, headers={"Authorization": f"Bearer {ROLE_KEY}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == [14990]


def test_grpc_health_takes_no_key_but_needs_the_clusters_tls(secure_cluster, secure_tls):
    """The internal gRPC side: no API key, but mutual TLS (a plaintext or certificate-less client is refused)."""
    ca, cert, key = (secure_tls[name].read_bytes() for name in ("ca", "cert", "key"))
    ways = {"plaintext": None, "tls_without_client_cert": grpc.ssl_channel_credentials(ca),
            "mtls": grpc.ssl_channel_credentials(ca, key, cert)}
    for role, _, address in secure_cluster.roles:
        for name, credentials in ways.items():
            channel = grpc.insecure_channel(address) if credentials is None else \
                grpc.secure_channel(address, credentials)
            with channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                except grpc.RpcError as exc:
                    assert name != "mtls", (role, exc)
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, (role, name, exc.code())
                    continue
            assert name == "mtls", (role, name)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, role
    assert "(TLS)" in "".join(secure_cluster.output)


def test_keys_never_appear_in_logs(secure_cluster):
    _call(secure_cluster.http_urls("decode")[0] + "/abort_requests", "POST", WRONG_KEY)
    output = "".join(secure_cluster.output)
    assert "requires an API key" in output
    for key in (*PUBLIC_KEYS, ROLE_KEY, ADMIN_TOKEN, WRONG_KEY):
        assert key not in output


def test_without_keys_each_process_says_it_is_unauthenticated(shm_cluster):
    output = "".join(shm_cluster.output)
    for role in ROLES:
        assert f"the {role} HTTP API is unauthenticated" in output, role
    assert "the coordinator API is unauthenticated" in output
    assert "the coordinator admin API on 127.0.0.1 has no admin token" in output
