"""Rendering and reading Kubernetes manifests for the deploy tests.

Renders the kustomize overlays (`kubectl kustomize`, or a standalone `kustomize`) and the Helm chart
(helm-python-sdk, offline), validates documents against the Kubernetes OpenAPI schemas with
kubernetes-validate in strict mode (an unknown field fails), and offers small readers over the rendered
objects (pods, containers, effective EPD_* environment) for the semantic checks in checks.py.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CHART = ROOT / "deploy" / "helm" / "epd"
KUBE_VERSION = "1.33.0"
ROLES = ("render", "encode", "prefill", "decode")
Doc = dict[str, Any]


def tool(name: str) -> str | None:
    """A binary from this interpreter's environment (pip's bin dir, even when not on PATH), else PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def kustomize_command() -> list[str]:
    if kubectl := tool("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := tool("kustomize"):
        return [kustomize, "build"]
    pytest.skip("needs kubectl (kubectl kustomize) or kustomize on PATH")


def render_kustomize(directory: Path) -> list[Doc]:
    out = subprocess.run([*kustomize_command(), str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kustomize {directory.relative_to(ROOT)} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def _overlay(name: str) -> tuple[Doc, ...]:
    return tuple(render_kustomize(K8S / "base" if name == "base" else K8S / "overlays" / name))


def overlay(name: str) -> list[Doc]:
    """`base` or an overlay of deploy/k8s, rendered once per test session (do not mutate: deepcopy)."""
    return list(_overlay(name))


def render_helm(values: dict[str, Any] | None = None, release: str = "epd") -> list[Doc]:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values=values, name=release, namespace="default")
    return [d for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _cache_schema_files() -> None:
    """kubernetes-validate re-reads and re-parses its 1.4 MB definitions file for every document (~60 ms);
    memoizing the (read-only) parsed files keeps the results identical and the tests fast."""
    from kubernetes_validate import utils

    if not hasattr(utils.schema_contents, "cache_info"):
        utils.schema_contents = functools.cache(utils.schema_contents)


def validate_strict(docs: list[Doc]) -> list[str]:
    """Problems found by kubernetes-validate --strict; a kind without a schema is a problem too."""
    import kubernetes_validate

    _cache_schema_files()
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            problems.append(f"{name_of(doc)}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name_of(doc)}: {exc.message}")
    return problems


def name_of(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert matches, f"no {kind}/{name} in {sorted(name_of(d) for d in docs)}"
    return matches[0]


def containers(deployment: Doc) -> list[Doc]:
    return deployment["spec"]["template"]["spec"]["containers"]


def epd_containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc, str]]:
    """(deployment, container, epd command) for every container that runs `epd <command>`."""
    for deployment in of_kind(docs, "Deployment"):
        for container in containers(deployment):
            args = container.get("args") or []
            if container["image"].split(":")[0].endswith("epd") and args:
                yield deployment, container, args[0]


def config_data(docs: list[Doc], name: str) -> dict[str, str]:
    return dict(find(docs, "ConfigMap", name).get("data") or {})


REF = "<valueFrom>"


def effective_env(docs: list[Doc], container: Doc) -> dict[str, str]:
    """ConfigMaps from envFrom, then `env` values (which win); a value from a Secret or the downward API
    reads as REF (known only at run time)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        env.update(config_data(docs, source["configMapRef"]["name"]))
    for var in container.get("env") or []:
        env[var["name"]] = var["value"] if "value" in var else REF
    return env


def port_number(container: Doc, port: int | str) -> int:
    """A probe's port, resolving a named port against the container's ports."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports") or [] if "name" in p}
    assert port in named, f"container {container['name']}: no port named {port!r}"
    return named[port]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
