"""Roles on separate hosts, over TCP only: greedy answers identical to a one-host run and to Hugging Face
`generate`, and the coordinator's gRPC to the roles is mutual TLS."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.images import chat, noise_image
from tests.support.multihost import HOSTS, ROLE_HOSTS, SERVER_NAME

MAX_TOKENS = 12
CASES = {
    "text": ("Tell me a story about a lighthouse.", []),
    "one_image": ("Describe this image.", [(64, 48, 1)]),
    "two_images": ("Compare these two images.", [(56, 84, 2), (112, 56, 3)]),
    "repeated_image": ("Are these the same?", [(64, 64, 4), (64, 64, 4)]),
}


def _ask(url: str, case: str, stream: bool = False) -> tuple[list[int] | None, str]:
    text, spec = CASES[case]
    body = chat(text, [noise_image(w, h, s) for w, h, s in spec], max_tokens=MAX_TOKENS, temperature=0,
                return_token_ids=True, stream=stream)
    with httpx.Client(timeout=120) as client:
        reply = client.post(url + "/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        return choice["token_ids"], choice["message"]["content"]
    events = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return None, "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_answers_equal_one_host_and_generate(multihost, shm_cluster, reference, case):
    text, spec = CASES[case]
    expected = reference.greedy(text, [noise_image(w, h, s) for w, h, s in spec], MAX_TOKENS)
    across_hosts, one_host = _ask(multihost.url, case), _ask(shm_cluster.url, case)
    assert across_hosts[0] == one_host[0] == expected
    assert across_hosts[1] == one_host[1] == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert _ask(multihost.url, case, stream=True)[1] == across_hosts[1]


def test_every_role_instance_is_on_its_own_host(multihost):
    listed = httpx.get(multihost.url + "/cluster", timeout=10).json()["instances"]
    addresses = sorted((i["role"], i["grpc_address"]) for i in listed)
    assert addresses == sorted((role, multihost.grpc_address(h)) for role, hosts in ROLE_HOSTS.items()
                               for h in hosts)
    assert all(i["healthy"] for i in listed)
    assert len({multihost.hosts.ip(h) for h in HOSTS}) == len(HOSTS)   # one address per host, none loopback
    assert not any(a.startswith("127.") for _, a in addresses)


def test_roles_take_grpc_only_with_a_client_certificate(multihost):
    """mTLS: the CA alone (no client certificate) or plaintext is refused; the coordinator's certificate works."""
    folder, target = multihost.folder, multihost.grpc_address("decode0")
    ca = (folder / "ca.pem").read_bytes()
    options = (("grpc.ssl_target_name_override", SERVER_NAME),)

    def check(credentials: grpc.ChannelCredentials | None) -> bool:
        channel = grpc.secure_channel(target, credentials, options) if credentials else grpc.insecure_channel(target)
        with channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return True
            except grpc.RpcError:
                return False

    mutual = grpc.ssl_channel_credentials(ca, (folder / "key.pem").read_bytes(), (folder / "cert.pem").read_bytes())
    assert check(mutual)
    assert not check(grpc.ssl_channel_credentials(ca))
    assert not check(None)


def test_roles_export_scaling_signals_and_the_coordinator_a_ratio(multihost):
    """After traffic: each model role's busy fraction is in (0, 1], encode exports its queued embeddings, and GET
    /cluster carries the E:P:D ratio the capacity model recommends (also as metrics)."""
    for case in sorted(CASES):
        _ask(multihost.url, case)
    for host, role in (("encode0", "encode"), ("encode1", "encode"), ("prefill", "prefill"),
                       ("decode0", "decode"), ("decode1", "decode")):
        text = httpx.get(multihost.http_url(host) + "/metrics", timeout=10).text
        busy = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(f'epd_role_busy_fraction{{role="{role}"}}')]
        assert len(busy) <= 1 and all(0.0 <= b <= 1.0 for b in busy), (host, busy)
        if role == "encode":
            assert "\nepd_encode_queued_items " in text
    prefill = httpx.get(multihost.http_url("prefill") + "/metrics", timeout=10).text
    assert 0.0 < float(next(line for line in prefill.splitlines()
                            if line.startswith('epd_role_busy_fraction{role="prefill"}')).rsplit(" ", 1)[1]) <= 1.0
    capacity = httpx.get(multihost.url + "/cluster", timeout=10).json()["capacity"]
    assert capacity["instances"] == {"encode": 2, "prefill": 1, "decode": 2}
    assert capacity["load"]["prefill"] > 0 and capacity["load"]["decode"] > 0
    assert capacity["ratio_text"].count(":") == 2 and min(v for v in capacity["ratio"].values() if v) == 1.0
    metrics = httpx.get(multihost.url + "/metrics", timeout=10).text
    assert 'epd_coordinator_recommended_instances{role="decode"}' in metrics
