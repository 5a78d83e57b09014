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
