"""The semantic checks and the strict validator catch what they claim to (each fed a broken copy)."""

from __future__ import annotations

import copy

from . import checks
from .manifests import containers, find, overlay, validate_strict


def broken(name: str, edit) -> list:
    docs = copy.deepcopy(overlay(name))
    edit(docs)
    return docs


def container(docs, deployment: str, name: str) -> dict:
    return next(c for c in containers(find(docs, "Deployment", deployment)) if c["name"] == name)


def env_var(c: dict, name: str) -> dict:
    return next(v for v in c["env"] if v["name"] == name)


def test_strict_validation_rejects_a_misspelt_field():
    def typo(docs):
        container(docs, "epd-encode", "encode")["readinesProbe"] = {"tcpSocket": {"port": 8002}}

    problems = validate_strict(broken("multi-node", typo))
    assert any("epd-encode" in p and "readinesProbe" in p for p in problems)


def test_service_links_left_on_are_caught():
    def links_on(docs):
        find(docs, "Deployment", "epd-decode")["spec"]["template"]["spec"]["enableServiceLinks"] = True

    assert any("enableServiceLinks" in p for p in checks.pod_hygiene(broken("multi-node", links_on)))


def test_an_unknown_or_invalid_setting_is_caught():
    def unknown(docs):
        container(docs, "epd-prefill", "prefill")["env"].append({"name": "EPD_KV_CONECTOR", "value": "shm"})

    def invalid(docs):
        container(docs, "epd-prefill", "prefill")["env"].append({"name": "EPD_KV_CONNECTOR", "value": "nfs"})

    assert any("EPD_KV_CONECTOR" in p for p in checks.epd_settings(broken("multi-node", unknown)))
    assert any("kv_connector" in p for p in checks.epd_settings(broken("multi-node", invalid)))


def test_a_probe_on_the_wrong_port_or_path_is_caught():
    def wrong(docs):
        container(docs, "epd-encode", "encode")["livenessProbe"]["httpGet"]["port"] = 8001

    def readiness_as_liveness(docs):
        container(docs, "epd-decode", "decode")["livenessProbe"]["httpGet"]["path"] = "/ready"

    assert checks.probes_match_ports(broken("multi-node", wrong)) == [
        "Deployment/epd-encode/encode: livenessProbe must GET /health on 8002"]
    assert checks.probes_match_ports(broken("multi-node", readiness_as_liveness)) == [
        "Deployment/epd-decode/decode: livenessProbe must GET /health on 8004"]


def test_a_pod_that_would_kill_its_draining_requests_is_caught():
    def short(docs):
        next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "epd-decode")[
            "spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30

    assert checks.probes_and_drain(broken("multi-node", short)) == [
        "Deployment/epd-decode/decode: terminationGracePeriodSeconds 30 < EPD_SHUTDOWN_GRACE_S 50 + 5: running "
        "requests would be killed before they finish"]
    assert checks.probes_and_drain(broken("multi-node", lambda docs: None)) == []


def test_a_coordinator_address_that_leads_nowhere_is_caught():
    def wrong(docs):
        env_var(container(docs, "epd-coordinator", "coordinator"), "EPD_ENCODE_URLS")["value"] = "epd-encode:50053"

    def local(docs):
        env_var(container(docs, "epd", "coordinator"), "EPD_DECODE_URLS")["value"] = "127.0.0.1:50053"

    assert any("encode address" in p for p in checks.coordinator_wiring(broken("multi-node", wrong)))
    assert any("decode address" in p for p in checks.coordinator_wiring(broken("single-node", local)))


def test_shm_without_a_shared_memory_volume_is_caught():
    def no_medium(docs):
        volumes = find(docs, "Deployment", "epd")["spec"]["template"]["spec"]["volumes"]
        next(v for v in volumes if v["name"] == "shm")["emptyDir"].pop("medium")

    def shm_across_pods(docs):
        for d in docs:
            if d["kind"] == "ConfigMap":
                d["data"]["EPD_EC_CONNECTOR"] = "shm"

    assert any("medium: Memory" in p for p in checks.connector_wiring(broken("single-node", no_medium)))
    assert any("not in one pod" in p for p in checks.connector_wiring(broken("multi-node", shm_across_pods)))


def test_an_autoscaler_on_a_metric_the_role_does_not_export_is_caught():
    def rename(docs):
        hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "epd-decode")
        hpa["spec"]["metrics"][1]["pods"]["metric"]["name"] = "epd_decode_waiting"

    problems = checks.autoscaler_signals(broken("multi-node", rename))
    assert len(problems) == 1 and problems[0].startswith("HorizontalPodAutoscaler/epd-decode: scales on")


def test_a_workload_without_budget_or_autoscaler_is_caught():
    def drop(docs):
        docs[:] = [d for d in docs if not (d["kind"] in ("PodDisruptionBudget", "HorizontalPodAutoscaler")
                                           and d["metadata"]["name"] == "epd-render")]

    problems = checks.budgets_and_autoscalers(broken("multi-node", drop))
    assert any("PodDisruptionBudget" in p for p in problems) and any("HorizontalPodAutoscaler" in p for p in problems)


def test_an_announcement_that_reaches_no_coordinator_is_caught():
    def wrong_port(docs):
        env_var(container(docs, "epd-encode", "encode"), "EPD_COORDINATOR_URL")["value"] = "http://epd:8001"

    def no_advertise(docs):
        env = container(docs, "epd-decode", "decode")["env"]
        env[:] = [v for v in env if v["name"] != "EPD_ADVERTISE_HOST"]

    assert any("reaches no coordinator" in p for p in checks.registration_wiring(broken("multi-node", wrong_port)))
    assert any("EPD_ADVERTISE_HOST" in p for p in checks.registration_wiring(broken("multi-node", no_advertise)))


def test_announcing_to_the_public_port_is_caught():
    def public(docs):
        env_var(container(docs, "epd-encode", "encode"), "EPD_COORDINATOR_URL")["value"] = "http://epd:8000"

    assert any("reaches no coordinator" in p for p in checks.registration_wiring(broken("multi-node", public)))


def test_keys_in_plain_text_or_missing_are_caught():
    def plain(docs):
        var = env_var(container(docs, "epd-coordinator", "coordinator"), "EPD_ADMIN_TOKEN")
        var.clear()
        var.update({"name": "EPD_ADMIN_TOKEN", "value": "in-the-manifest"})

    def missing(docs):
        env = container(docs, "epd-prefill", "prefill")["env"]
        env[:] = [v for v in env if v["name"] != "EPD_API_KEY"]

    problems = checks.secrets_wiring(broken("multi-node", plain))
    assert any("EPD_ADMIN_TOKEN is set in plain text" in p for p in problems)
    assert any("beyond loopback without EPD_ADMIN_TOKEN from a Secret" in p for p in problems)
    assert any("epd-prefill/prefill: EPD_API_KEY does not come from a Secret" in p
               for p in checks.secrets_wiring(broken("multi-node", missing)))


def test_open_grpc_and_admin_ports_are_caught():
    def open_grpc(docs):
        find(docs, "NetworkPolicy", "epd-roles")["spec"]["ingress"][0]["from"] = []

    def admin_from_anyone(docs):
        rule = find(docs, "NetworkPolicy", "epd-coordinator")["spec"]["ingress"][1]
        rule["from"] = [{"namespaceSelector": {}}]

    def no_policy(docs):
        docs[:] = [d for d in docs if d["kind"] != "NetworkPolicy" or d["metadata"]["name"] != "epd-roles"]

    assert any("epd-encode/encode port 50052: NetworkPolicy/epd-roles admits anyone" in p
               for p in checks.network_policies(broken("multi-node", open_grpc)))
    assert any("port 8081" in p and "only role pods may" in p
               for p in checks.network_policies(broken("multi-node", admin_from_anyone)))
    assert any("epd-decode/decode port 50054: no NetworkPolicy selects the pod" in p
               for p in checks.network_policies(broken("multi-node", no_policy)))


def test_the_placeholder_credentials_of_the_base_are_refused():
    import pytest

    from services.config import ConfigError, EpdConfig
    from tests.deploy.manifests import K8S

    for name, field in (("api-keys", "api_key"), ("admin-token", "admin_token")):
        placeholder = (K8S / "base" / "common" / "secrets" / name).read_text()
        with pytest.raises(ConfigError, match="still the placeholder"):
            EpdConfig.of(**{field: placeholder})


def test_a_model_role_without_its_kernel_choices_volume_is_caught():
    def unmounted(docs):
        c = container(docs, "epd-prefill", "prefill")
        c["volumeMounts"] = [m for m in c["volumeMounts"] if not m["mountPath"].endswith("/kernel-choices")]

    assert checks.kernel_choices_kept(overlay("multi-node")) == []
    assert checks.kernel_choices_kept(broken("multi-node", unmounted)) == [
        "Deployment/epd-prefill/prefill: no volume at /opt/epd/models/kernel-choices (read-only root filesystem)"]
