"""Hostile credentials and control-plane games against the secured cluster: each a 4xx JSON error, never 5xx.

Auth headers (none, wrong, another scheme, empty, enormous, the roles' key or
the admin token on the public port), admin routes on the public port and
admin calls without or with the wrong credential.  Oversized and trickled
bodies, duplicate ids and deadlines have their own tests (test_limits.py,
test_request_ids.py).  Afterwards the cluster still serves.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import ADMIN_TOKEN, PUBLIC_KEYS, ROLE_KEY

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
AUTH_GAMES = {
    "no_header": None,
    "wrong_key": "Bearer sk-epd-guess",
    "basic_scheme": "Basic c2stZXBkOnBhc3N3b3Jk",
    "bearer_without_key": "Bearer",
    "key_with_junk": f"Bearer {PUBLIC_KEYS[0]}x",
    "key_prefix": f"Bearer {PUBLIC_KEYS[0][:-1]}",
    "enormous_header": "Bearer " + "k" * 16_000,
    "role_key_on_public": f"Bearer {ROLE_KEY}",
    "admin_token_on_public": f"Bearer {ADMIN_TOKEN}",
    "key_without_scheme": PUBLIC_KEYS[0],
}
PUBLIC_ROUTES = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {"prompt": "hi"}),
                 ("POST", "/inference/v1/generate", GENERATE), ("GET", "/v1/models", None), ("GET", "/cluster", None),
                 ("GET", "/openapi.json", None)]
ADMIN_GAMES = {
    "admin_without_token": None,
    "admin_wrong_token": "Bearer nope",
    "admin_role_key": f"Bearer {ROLE_KEY}",
    "admin_api_key_registers": f"Bearer {PUBLIC_KEYS[0]}",
}


def _check(reply: httpx.Response, statuses: tuple[int, ...]) -> dict:
    assert reply.status_code in statuses, (reply.status_code, reply.text[:300])
    error = reply.json()["error"]
    assert {"message", "type", "code"} <= set(error)
    return error


@pytest.mark.parametrize("game", sorted(AUTH_GAMES))
def test_public_routes_refuse_bad_credentials(secure_cluster, game):
    value = AUTH_GAMES[game]
    headers = {"Authorization": value} if value is not None else {}
    for method, path, body in PUBLIC_ROUTES:
        reply = httpx.request(method, secure_cluster.url + path, json=body, headers=headers, timeout=30)
        _check(reply, (401,) if game != "enormous_header" else (400, 401, 431))
        assert PUBLIC_KEYS[0] not in reply.text and ROLE_KEY not in reply.text and ADMIN_TOKEN not in reply.text


@pytest.mark.parametrize("game", sorted(ADMIN_GAMES))
def test_admin_routes_refuse_bad_credentials(secure_cluster, game):
    value = ADMIN_GAMES[game]
    headers = {"Authorization": value} if value is not None else {}
    body = {"role": "encode", "grpc_address": "10.9.9.9:50052"}
    for method in ("POST", "DELETE"):
        reply = httpx.request(method, secure_cluster.admin_url + "/v1/instances", json=body, headers=headers,
                              timeout=30)
        _check(reply, (403,) if game == "admin_api_key_registers" else (401,))


def test_control_routes_on_the_public_port_are_404_even_with_a_key(secure_cluster):
    headers = {"Authorization": f"Bearer {PUBLIC_KEYS[0]}"}
    for path, body in (("/v1/instances", {"role": "encode", "grpc_address": "10.9.9.9:50052"}),
                       ("/abort_requests", {"request_ids": ["x"]})):
        assert _check(httpx.post(secure_cluster.url + path, json=body, headers=headers, timeout=30),
                      (404,))["code"] == "route_not_found"


def test_the_secured_cluster_still_serves_and_registered_nothing(secure_cluster):
    headers = {"Authorization": f"Bearer {PUBLIC_KEYS[1]}"}
    reply = httpx.post(secure_cluster.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    listed = httpx.get(secure_cluster.admin_url + "/v1/instances", timeout=10,
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["data"]
    assert "10.9.9.9:50052" not in {i["grpc_address"] for i in listed}
