"""deploy/helm/epd: lints clean, renders offline for each supported combination of values, every rendered
object passes strict schema validation and the same semantic checks as the kustomize overlays, and
combinations that cannot work are refused at render time with a message saying why."""

from __future__ import annotations

from typing import Any

import pytest

from . import checks
from .manifests import (
    CHART,
    ROLES,
    effective_env,
    epd_containers,
    find,
    name_of,
    of_kind,
    overlay,
    render_helm,
    validate_strict,
)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extras")

VALUES: dict[str, dict[str, Any]] = {
    "defaults (multi-node, internal redis)": {},
    "single-node (shm)": {"layout": "single-node"},
    "single-node with redis": {"layout": "single-node", "connector": "redis"},
    "gpu": {"gpu": {"enabled": True}, "image": {"torchVariant": "cu128"}},
    "external redis from a secret": {"redis": {"internal": False, "existingSecret": "my-redis"}},
    "external redis url, fixed replicas, model cache claim": {
        "redis": {"internal": False, "url": "redis://redis.example:6379/0"},
        "roles": {"encode": {"autoscaling": {"enabled": False}, "replicas": 3}},
        "coordinator": {"autoscaling": {"enabled": False}},
        "model": {"name": "Qwen/Qwen2-VL-2B-Instruct", "cache": {"existingClaim": "models"},
                  "hfTokenSecret": "hf-token"},
        "env": {"EPD_LOG_LEVEL": "debug", "EPD_DECODE_SLOTS": 32},
    },
}
_CACHE: dict[str, list] = {}


def rendered(label: str) -> list:
    if label not in _CACHE:
        _CACHE[label] = render_helm(VALUES[label])
    return _CACHE[label]


@pytest.mark.parametrize("label", list(VALUES))
def test_lint_has_no_warnings_or_errors(label):
    report = helm.lint(str(CHART), VALUES[label], strict=True, kube_version="v1.33.0")
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and serious == []


@pytest.mark.parametrize("label", list(VALUES))
def test_renders_and_passes_strict_validation(label):
    docs = rendered(label)
    assert docs
    assert validate_strict(docs) == []


@pytest.mark.parametrize("label", list(VALUES))
def test_objects_fit_together(label):
    docs = rendered(label)
    autoscaled = label != "external redis url, fixed replicas, model cache claim"
    assert checks.run_all(docs, autoscaled=autoscaled) == []


def test_defaults_have_the_same_objects_as_the_multi_node_overlay():
    def shape(docs):
        return sorted(name_of(d) for d in docs if d["kind"] != "ConfigMap")

    assert shape(rendered("defaults (multi-node, internal redis)")) == shape(overlay("multi-node"))
    assert shape(rendered("single-node (shm)")) == shape(overlay("single-node"))


def test_replicas_per_role_apply_when_autoscaling_is_off():
    docs = rendered("external redis url, fixed replicas, model cache claim")
    assert find(docs, "Deployment", "epd-encode")["spec"]["replicas"] == 3
    assert not [h for h in of_kind(docs, "HorizontalPodAutoscaler")
                if h["spec"]["scaleTargetRef"]["name"] in ("epd-encode", "epd-coordinator")]
    volumes = find(docs, "Deployment", "epd-prefill")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "models"}} in volumes


def test_gpu_values_put_model_roles_on_gpus():
    docs = rendered("gpu")
    for deployment, container, command in epd_containers(docs):
        on_gpu = "nvidia.com/gpu" in container["resources"]["limits"]
        assert on_gpu == (command in ("encode", "prefill", "decode")), name_of(deployment)
        if on_gpu:
            assert effective_env(docs, container)["EPD_DEVICE"] == "cuda"
            assert container["image"] == "epd:0.1.0-cu128"


def test_role_autoscalers_follow_the_values_signals():
    docs = render_helm({"roles": {"decode": {"autoscaling": {"targetBusyFraction": "500m", "targetQueuePerPod": 6}}},
                        "coordinator": {"autoscaling": {"enabled": True}}})
    decode = find(docs, "HorizontalPodAutoscaler", "epd-decode")["spec"]["metrics"]
    assert [(m["type"], m.get("pods", {}).get("target", {}).get("averageValue")) for m in decode] == [
        ("Pods", "500m"), ("Pods", "6"), ("Resource", None)]
    coordinator = find(docs, "HorizontalPodAutoscaler", "epd-coordinator")["spec"]["metrics"]
    assert [m["type"] for m in coordinator] == ["Resource"]   # no model: CPU only


def test_release_name_prefixes_every_object_and_address():
    docs = render_helm({}, release="prod")
    assert {d["metadata"]["name"] for d in of_kind(docs, "Deployment")} == {
        *(f"prod-epd-{r}" for r in ROLES), "prod-epd-coordinator", "prod-epd-redis"}
    assert checks.coordinator_wiring(docs) == [] and checks.connector_wiring(docs) == []


@pytest.mark.parametrize(("values", "message"), [
    ({"connector": "shm"}, "multi-node needs connector redis"),
    ({"layout": "single-node", "gpu": {"enabled": True}}, "gpu.enabled needs connector redis"),
    ({"redis": {"internal": False}}, "set redis.url or redis.existingSecret"),
    ({"layout": "one-box"}, "layout"),
    ({"roles": {"encode": {"replica": 2}}}, "replica"),
    ({"roles": {"render": {"autoscaling": {"targetQueuePerPod": 3}}}}, "targetQueuePerPod applies to encode"),
    ({"roles": {"decode": {"autoscaling": {"targetBusyFraction": "lots"}}}}, "targetBusyFraction"),
])
def test_combinations_that_cannot_work_are_refused(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render_helm(values)
