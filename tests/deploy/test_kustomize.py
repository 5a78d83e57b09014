"""deploy/k8s: every overlay renders with kustomize, passes strict schema validation, and fits together."""

from __future__ import annotations

import pytest

from . import checks
from .manifests import (
    K8S,
    ROLES,
    config_data,
    containers,
    effective_env,
    epd_containers,
    find,
    name_of,
    of_kind,
    overlay,
    validate_strict,
)

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
rendered = overlay


def test_the_expected_overlays_exist():
    assert {"single-node", "multi-node", "gpu", "external-redis"} <= set(OVERLAYS)


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_renders_and_passes_strict_validation(name):
    docs = rendered(name)
    assert docs
    assert validate_strict(docs) == []


@pytest.mark.parametrize("name", OVERLAYS)
def test_objects_fit_together(name):
    assert checks.run_all(rendered(name)) == []


def test_base_has_one_deployment_service_pdb_hpa_per_role_and_coordinator():
    docs = rendered("base")
    for component in (*ROLES, "coordinator"):
        name = f"epd-{component}"
        find(docs, "Deployment", name)
        find(docs, "PodDisruptionBudget", name)
        find(docs, "HorizontalPodAutoscaler", name)
    for role in ROLES:
        # Headless, so a gRPC client sees each pod rather than one connection pinned through a ClusterIP.
        assert find(docs, "Service", f"epd-{role}")["spec"]["clusterIP"] == "None"
    assert find(docs, "Service", "epd")["spec"]["selector"]["app.kubernetes.io/component"] == "coordinator"
    assert [p for check in (checks.pod_hygiene, checks.epd_settings, checks.probes_match_ports,
                            checks.coordinator_wiring) for p in check(docs)] == []


def _settings(docs):
    return config_data(docs, of_kind(docs, "ConfigMap")[0]["metadata"]["name"])


def test_single_node_is_one_pod_sharing_memory_backed_dev_shm():
    docs = rendered("single-node")
    deployments = of_kind(docs, "Deployment")
    assert [name_of(d) for d in deployments] == ["Deployment/epd"]
    assert sorted(c["name"] for c in containers(deployments[0])) == sorted([*ROLES, "coordinator"])
    volumes = {v["name"]: v for v in deployments[0]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    settings = _settings(docs)
    assert (settings["EPD_EC_CONNECTOR"], settings["EPD_KV_CONNECTOR"]) == ("shm", "shm")
    assert not [d for d in of_kind(docs, "Deployment") if "redis" in d["metadata"]["name"]]


def test_multi_node_uses_redis_in_the_cluster():
    docs = rendered("multi-node")
    settings = _settings(docs)
    assert (settings["EPD_EC_CONNECTOR"], settings["EPD_KV_CONNECTOR"]) == ("redis", "redis")
    assert settings["EPD_REDIS_URL"] == "redis://epd-redis:6379/0"
    find(docs, "Deployment", "epd-redis")
    find(docs, "Service", "epd-redis")
    find(docs, "NetworkPolicy", "epd-redis")


def test_external_redis_reads_the_url_from_a_secret():
    docs = rendered("external-redis")
    assert not [d for d in docs if d["metadata"]["name"] == "epd-redis"]
    for deployment, container, command in epd_containers(docs):
        if command in ("encode", "prefill", "decode"):
            refs = [v["valueFrom"]["secretKeyRef"] for v in container["env"] if v["name"] == "EPD_REDIS_URL"]
            assert refs == [{"name": "epd-redis", "key": "url"}], name_of(deployment)


def test_gpu_puts_model_roles_on_gpus():
    docs = rendered("gpu")
    for deployment, container, command in epd_containers(docs):
        limits = container["resources"]["limits"]
        env = effective_env(docs, container)
        if command in ("encode", "prefill", "decode"):
            assert limits.get("nvidia.com/gpu") == "1", name_of(deployment)
            assert env["EPD_DEVICE"] == "cuda" and container["image"].endswith("-cu128")
        else:
            assert "nvidia.com/gpu" not in limits, name_of(deployment)
    assert _settings(docs)["EPD_EC_CONNECTOR"] == "redis"
