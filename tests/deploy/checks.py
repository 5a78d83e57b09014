"""Semantic checks over rendered manifests, shared by the kustomize and Helm tests.

Schema validation proves each object is well formed; these prove the objects fit together and fit epd:
every EPD_* variable is a real setting with a valid value, probes hit the ports the process listens on,
the coordinator's addresses lead to the right role, every workload has its PDB and HPA, pods run
hardened, and the connector wiring matches the layout.  Each check returns a list of problems.
"""

from __future__ import annotations

import argparse

from services.config import ConfigError, EpdConfig, from_args, schema

from .manifests import (
    REF,
    ROLES,
    ROOT,
    Doc,
    containers,
    effective_env,
    epd_containers,
    name_of,
    of_kind,
    port_number,
    selects,
)

SETTINGS = {entry["env"] for entry in schema()}


def pod_hygiene(docs: list[Doc]) -> list[str]:
    problems = []
    for deployment in of_kind(docs, "Deployment"):
        pod, where = deployment["spec"]["template"]["spec"], name_of(deployment)
        if pod.get("enableServiceLinks") is not False:
            problems.append(f"{where}: enableServiceLinks must be false (Service `epd` would set EPD_PORT)")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: automountServiceAccountToken must be false")
        if not (pod.get("securityContext") or {}).get("runAsNonRoot"):
            problems.append(f"{where}: pod securityContext.runAsNonRoot must be true")
        for c in pod["containers"]:
            problems += _container_hygiene(f"{where}/{c['name']}", c)
    return problems


def _container_hygiene(where: str, c: Doc) -> list[str]:
    problems = []
    resources = c.get("resources") or {}
    for kind in ("requests", "limits"):
        if not {"cpu", "memory"} <= set(resources.get(kind) or {}):
            problems.append(f"{where}: resources.{kind} needs cpu and memory")
    for probe in ("readinessProbe", "livenessProbe"):
        if probe not in c:
            problems.append(f"{where}: no {probe}")
    sc = c.get("securityContext") or {}
    if sc.get("readOnlyRootFilesystem") is not True or sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: needs readOnlyRootFilesystem and no privilege escalation")
    return problems


# Settings that come from a Secret at run time: validated with a stand-in value (their names are checked).
SECRET_SETTINGS = ("EPD_API_KEY", "EPD_ROLE_API_KEY", "EPD_ADMIN_TOKEN")


def runtime_config_env(env: dict[str, str]) -> dict[str, str]:
    """The variables a config can be built from here: run-time values dropped, secrets stood in for."""
    return {k: ("stand-in-secret" if k in SECRET_SETTINGS else None) if v == REF else v
            for k, v in env.items() if v != REF or k in SECRET_SETTINGS}


def epd_settings(docs: list[Doc]) -> list[str]:
    """Every EPD_* variable an epd container sees is a setting, and together they form a valid config."""
    problems = []
    for deployment, container, command in epd_containers(docs):
        where = f"{name_of(deployment)}/{container['name']}"
        env = {k: v for k, v in effective_env(docs, container).items() if k.startswith("EPD_")}
        unknown = sorted(set(env) - SETTINGS)
        if unknown:
            problems.append(f"{where}: not epd settings: {unknown}")
            continue
        problems += [f"{where}: {p}" for p in _config_problems(env, command)]
    return problems


def _config_problems(env: dict[str, str], command: str) -> list[str]:
    plain = runtime_config_env(env)
    try:
        config = from_args(argparse.Namespace(), plain)
    except ConfigError as exc:
        return [f"invalid configuration: {exc}"]
    if command in ROLES and not (config.server.grpc_port and config.server.http_port):
        return ["a role in a container needs fixed EPD_GRPC_PORT and EPD_HTTP_PORT"]
    if config.server.host != "0.0.0.0":
        return [f"EPD_HOST is {config.server.host!r}: probes and peers reach the pod IP, bind 0.0.0.0"]
    return []


def probes_match_ports(docs: list[Doc]) -> list[str]:
    """Role: startup and liveness GET /health, readiness GET /ready, all on EPD_HTTP_PORT (liveness never
    gRPC health: that follows readiness, and a Redis outage must not restart the pod)."""
    problems = []
    for deployment, c, command in epd_containers(docs):
        env, where = effective_env(docs, c), f"{name_of(deployment)}/{c['name']}"
        declared = {p["containerPort"] for p in c.get("ports") or []}
        if command in ROLES:
            grpc_port, http_port = int(env["EPD_GRPC_PORT"]), int(env["EPD_HTTP_PORT"])
            for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"),
                                ("readinessProbe", "/ready")):
                get = (c.get(probe) or {}).get("httpGet") or {}
                if get.get("path") != path or port_number(c, get.get("port", 0)) != http_port:
                    problems.append(f"{where}: {probe} must GET {path} on {http_port}")
            if not {grpc_port, http_port} <= declared:
                problems.append(f"{where}: containerPorts {declared} miss {grpc_port}/{http_port}")
        elif command == "coordinator":
            port = int(env.get("EPD_PORT", "8000"))
            get = c["readinessProbe"].get("httpGet") or {}
            if get.get("path") != "/ready" or port_number(c, get["port"]) != port or port not in declared:
                problems.append(f"{where}: readiness must GET /ready on EPD_PORT {port}")
    return problems


def coordinator_wiring(docs: list[Doc]) -> list[str]:
    """Each EPD_<ROLE>_URLS address reaches a container running that role on that gRPC port."""
    problems = []
    for deployment, c, command in epd_containers(docs):
        if command != "coordinator":
            continue
        env = effective_env(docs, c)
        for role in ROLES:
            for address in filter(None, env.get(f"EPD_{role.upper()}_URLS", "").split(",")):
                host, port = address.rsplit(":", 1)
                if not _reaches(docs, deployment, host, int(port), role):
                    problems.append(f"{name_of(deployment)}: {role} address {address} reaches no {role}")
    return problems


def registration_wiring(docs: list[Doc]) -> list[str]:
    """A role that announces itself (EPD_COORDINATOR_URL) names a Service in front of a coordinator's admin
    API (EPD_ADMIN_PORT, never its public EPD_PORT), and advertises an address (EPD_ADVERTISE_HOST) the
    coordinator can reach."""
    problems = []
    for deployment, c, command in epd_containers(docs):
        env = effective_env(docs, c)
        if command not in ROLES or not env.get("EPD_COORDINATOR_URL"):
            continue
        where = f"{name_of(deployment)}/{c['name']}"
        host, _, port = env["EPD_COORDINATOR_URL"].split("://", 1)[-1].rstrip("/").partition(":")
        if not _reaches_coordinator(docs, host, int(port or 80)):
            problems.append(f"{where}: EPD_COORDINATOR_URL {env['EPD_COORDINATOR_URL']} reaches no coordinator")
        if env.get("EPD_ADVERTISE_HOST", env.get("EPD_HOST")) in (None, "0.0.0.0", "127.0.0.1"):
            problems.append(f"{where}: announces itself without EPD_ADVERTISE_HOST (the pod IP)")
    return problems


def _reaches_coordinator(docs: list[Doc], host: str, port: int) -> bool:
    for service in of_kind(docs, "Service"):
        ports = {p["port"]: p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
        if service["metadata"]["name"] != host or port not in ports:
            continue
        return any(selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
                   and any(cmd == "coordinator" and port_number(c, ports[port]) == int(
                       effective_env(docs, c).get("EPD_ADMIN_PORT", "0")) for _, c, cmd in epd_containers([d]))
                   for d in of_kind(docs, "Deployment"))
    return False


def _reaches(docs: list[Doc], source: Doc, host: str, port: int, role: str) -> bool:
    if host in ("127.0.0.1", "localhost"):
        return any(_serves(docs, c, role, port) for c in containers(source))
    for service in of_kind(docs, "Service"):
        if service["metadata"]["name"] != host:
            continue
        ports = {p["port"]: p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
        if port not in ports:
            return False
        return any(selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
                   and any(_serves(docs, c, role, port_number(c, ports[port])) for c in containers(d))
                   for d in of_kind(docs, "Deployment"))
    return False


def _serves(docs: list[Doc], container: Doc, role: str, port: int) -> bool:
    args = container.get("args") or []
    return bool(args) and args[0] == role and effective_env(docs, container).get("EPD_GRPC_PORT") == str(port)


def budgets_and_autoscalers(docs: list[Doc], autoscaled: bool = True) -> list[str]:
    """Every epd workload (all but Redis) has a PodDisruptionBudget and, if autoscaled, an HPA."""
    problems = []
    pdbs, hpas = of_kind(docs, "PodDisruptionBudget"), of_kind(docs, "HorizontalPodAutoscaler")
    for d in of_kind(docs, "Deployment"):
        if not list(epd_containers([d])):
            continue
        labels = d["spec"]["template"]["metadata"]["labels"]
        if not any(selects(p["spec"]["selector"]["matchLabels"], labels) for p in pdbs):
            problems.append(f"{name_of(d)}: no PodDisruptionBudget selects it")
        target = [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == d["metadata"]["name"]]
        if autoscaled and not target:
            problems.append(f"{name_of(d)}: no HorizontalPodAutoscaler targets it")
        if target and "replicas" in d["spec"]:
            problems.append(f"{name_of(d)}: sets replicas although an HPA owns the count")
    return problems


def exported_metrics() -> dict[str, str]:
    """The scaling signals each role exports (read from the code, so a renamed metric breaks the manifests' test):
    role -> the queue metric an HPA may scale it on; "*" -> the busy fraction every model role exports."""
    from services.decode.metrics import ENGINE_GAUGES
    from services.encode.serving import GAUGES as ENCODE_GAUGES
    from services.observability.busy import BUSY
    from services.runtime.admission import QUEUE_DEPTH

    decode_queue, encode_queue = "epd_decode_queued", "epd_encode_queued_items"
    assert decode_queue in ENGINE_GAUGES and encode_queue in ENCODE_GAUGES
    return {"*": BUSY._name, "encode": encode_queue, "prefill": QUEUE_DEPTH._name, "decode": decode_queue}


def autoscaler_signals(docs: list[Doc]) -> list[str]:
    """The HPAs of encode, prefill and decode scale on that role's busy fraction and queue, names it exports."""
    problems, exported = [], exported_metrics()
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        target = next((d for d in of_kind(docs, "Deployment")
                       if d["metadata"]["name"] == hpa["spec"]["scaleTargetRef"]["name"]), None)
        role = target and target["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        if role not in ("encode", "prefill", "decode"):
            continue
        pods = [m["pods"] for m in hpa["spec"].get("metrics", []) if m["type"] == "Pods"]
        names = {(p["metric"]["name"], (p["metric"].get("selector") or {}).get("matchLabels", {}).get("role"))
                 for p in pods}
        want = {(exported["*"], role), (exported[role], "prefill" if role == "prefill" else None)}
        if names != want:
            problems.append(f"{name_of(hpa)}: scales on {sorted(names, key=str)}, not the role's signals "
                            f"{sorted(want, key=str)}")
    return problems


def connector_wiring(docs: list[Doc]) -> list[str]:
    """shm: the producing and consuming roles share one pod and a memory-backed /dev/shm.
    redis: every role can reach Redis (a Service in the render, or a URL from a Secret)."""
    problems = []
    for deployment, c, command in epd_containers(docs):
        config = from_args(argparse.Namespace(), runtime_config_env(
            {k: v for k, v in effective_env(docs, c).items() if k.startswith("EPD_")}))
        if command not in ("encode", "prefill", "decode"):
            continue
        where = f"{name_of(deployment)}/{c['name']}"
        if "shm" in (config.stores.ec_connector, config.stores.kv_connector):
            problems += [f"{where}: {p}" for p in _shm_problems(deployment, c)]
        if "redis" in (config.stores.ec_connector, config.stores.kv_connector):
            problems += [f"{where}: {p}" for p in _redis_problems(docs, c, config)]
    return problems


def _shm_problems(deployment: Doc, c: Doc) -> list[str]:
    roles_here = {(x.get("args") or [""])[0] for x in containers(deployment)}
    problems = [] if {"encode", "prefill", "decode"} <= roles_here else [
        "shm connector but encode, prefill and decode are not in one pod (an emptyDir is per pod)"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes") or []}
    mount = [m for m in c.get("volumeMounts") or [] if m["mountPath"] == "/dev/shm"]
    empty_dir = volumes.get(mount[0]["name"], {}).get("emptyDir") if mount else None
    if not empty_dir or empty_dir.get("medium") != "Memory" or not empty_dir.get("sizeLimit"):
        problems.append("shm connector needs an emptyDir {medium: Memory, sizeLimit} at /dev/shm")
    return problems


def _redis_problems(docs: list[Doc], c: Doc, config: EpdConfig) -> list[str]:
    if effective_env(docs, c).get("EPD_REDIS_URL") == REF:
        return []
    host = config.stores.redis_url.split("://", 1)[-1].rsplit("@", 1)[-1].split("/")[0].split(":")[0]
    if "." in host or any(s["metadata"]["name"] == host for s in of_kind(docs, "Service")):
        return []  # a Service of this deployment, or a host outside it (a dotted name or an address)
    return [f"redis connector, but EPD_REDIS_URL host {host!r} is no Service here"]


ALL = (pod_hygiene, epd_settings, probes_match_ports, coordinator_wiring, registration_wiring,
       connector_wiring)


# (readiness path, liveness path) per epd command: readiness means "can serve" (GET /ready), liveness only
# "runs" (never a check that a Redis outage fails, or the kubelet would restart healthy processes).
PROBE_PATHS = {"coordinator": ("/ready", "/health")}
ROLE_PROBE_PATHS = ("/ready", "/health")
STOP_MARGIN_S = 5.0


def probes_and_drain(docs: list[Doc]) -> list[str]:
    """Readiness is /ready and liveness /health (HTTP) on roles; the pod waits longer than the drain."""
    problems = []
    for deployment, c, command in epd_containers(docs):
        where = f"{name_of(deployment)}/{c['name']}"
        want = PROBE_PATHS.get(command, ROLE_PROBE_PATHS)
        got = tuple(((c.get(p) or {}).get("httpGet") or {}).get("path") for p in ("readinessProbe", "livenessProbe"))
        if got != want:
            problems.append(f"{where}: readiness/liveness probes are {got}, want {want}")
        grace = float(effective_env(docs, c).get("EPD_SHUTDOWN_GRACE_S", EpdConfig().server.shutdown_grace_s))
        waits = deployment["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        if waits < grace + STOP_MARGIN_S:
            problems.append(f"{where}: terminationGracePeriodSeconds {waits} < EPD_SHUTDOWN_GRACE_S {grace:g} + "
                            f"{STOP_MARGIN_S:g}: running requests would be killed before they finish")
    return problems


def secrets_wiring(docs: list[Doc]) -> list[str]:
    """Every epd container gets its API keys from a Secret (never a ConfigMap); a coordinator whose admin API
    listens beyond loopback gets its admin token from a Secret too."""
    problems = []
    for deployment, c, command in epd_containers(docs):
        where = f"{name_of(deployment)}/{c['name']}"
        from_secret = {v["name"] for v in c.get("env") or [] if "secretKeyRef" in v.get("valueFrom", {})}
        configured = effective_env(docs, c)
        if "EPD_API_KEY" not in from_secret:
            problems.append(f"{where}: EPD_API_KEY does not come from a Secret")
        for name in SECRET_SETTINGS:
            if name in configured and name not in from_secret:
                problems.append(f"{where}: {name} is set in plain text")
        if command == "coordinator" and configured.get("EPD_ADMIN_HOST", "127.0.0.1") not in ("127.0.0.1", "::1") \
                and "EPD_ADMIN_TOKEN" not in from_secret:
            problems.append(f"{where}: the admin API listens beyond loopback without EPD_ADMIN_TOKEN from a Secret")
    return problems


def _policies_for(docs: list[Doc], labels: dict[str, str]) -> list[Doc]:
    return [p for p in of_kind(docs, "NetworkPolicy") if _matches(p["spec"]["podSelector"], labels)]


def _matches(selector: Doc, labels: dict[str, str]) -> bool:
    if not selects(selector.get("matchLabels") or {}, labels):
        return False
    return all(labels.get(e["key"]) in e["values"] if e["operator"] == "In" else False
               for e in selector.get("matchExpressions") or [])


def _peers(policy: Doc, container: Doc, port: int) -> list[Doc] | None:
    """The `from` peers an ingress rule allows on `port` ([] = from anywhere), None when no rule allows it."""
    allowed: list[Doc] | None = None
    for rule in policy["spec"].get("ingress") or []:
        ports = [port_number(container, p["port"]) for p in rule.get("ports") or []]
        if ports and port not in ports:
            continue
        if not rule.get("from"):
            return []
        allowed = (allowed or []) + rule["from"]
    return allowed


def network_policies(docs: list[Doc]) -> list[str]:
    """A role's gRPC port admits only coordinator pods, a coordinator's admin port only role pods, whenever a
    pod's gRPC or admin port is reachable from other pods (a port bound to loopback needs no policy)."""
    problems = []
    for deployment, c, command in epd_containers(docs):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        env = effective_env(docs, c)
        if command in ROLES and env.get("EPD_GRPC_HOST") in ("127.0.0.1", "::1"):
            continue  # bound to the pod's loopback: nothing outside the pod reaches it
        if command in ROLES:
            port, allowed_from = int(env.get("EPD_GRPC_PORT", "0")), "coordinator"
        elif command == "coordinator" and env.get("EPD_ADMIN_HOST", "127.0.0.1") not in ("127.0.0.1", "::1"):
            port, allowed_from = int(env["EPD_ADMIN_PORT"]), "role"
        else:
            continue
        where = f"{name_of(deployment)}/{c['name']} port {port}"
        policies = _policies_for(docs, labels)
        if not policies:
            problems.append(f"{where}: no NetworkPolicy selects the pod")
            continue
        for policy in policies:
            peers = _peers(policy, c, port)
            if peers == []:
                problems.append(f"{where}: {name_of(policy)} admits anyone")
            for peer in peers or []:
                component = (peer.get("podSelector") or {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                values = [e["values"] for e in (peer.get("podSelector") or {}).get("matchExpressions") or []
                          if e["key"] == "app.kubernetes.io/component"]
                ok = component == "coordinator" if allowed_from == "coordinator" else \
                    bool(values) and set(values[0]) <= set(ROLES)
                if not ok or "ipBlock" in peer or "namespaceSelector" in peer:
                    problems.append(f"{where}: {name_of(policy)} admits {peer} (only {allowed_from} pods may)")
    return problems


def kernel_choices_kept(docs: list[Doc]) -> list[str]:
    """A model role on a read-only root filesystem mounts a volume where it keeps its kernel choices
    (EPD_CACHE_DIR/kernel-choices, services/models/kernel_choices.py): else every start times them again."""
    image_cache = next(line.split("=", 1)[1] for line in (ROOT / "deploy/docker/Dockerfile").read_text().splitlines()
                       if line.startswith("ENV EPD_CACHE_DIR="))
    problems = []
    for deployment, c, command in epd_containers(docs):
        want = effective_env(docs, c).get("EPD_CACHE_DIR", image_cache).rstrip("/") + "/kernel-choices"
        read_only = (c.get("securityContext") or {}).get("readOnlyRootFilesystem")
        if command in ("encode", "prefill", "decode") and read_only and want not in {
                m["mountPath"] for m in c.get("volumeMounts") or []}:
            problems.append(f"{name_of(deployment)}/{c['name']}: no volume at {want} (read-only root filesystem)")
    return problems


def run_all(docs: list[Doc], autoscaled: bool = True) -> list[str]:
    problems = [p for check in (*ALL, probes_and_drain, secrets_wiring, network_policies, autoscaler_signals,
                                kernel_choices_kept) for p in check(docs)]
    return problems + budgets_and_autoscalers(docs, autoscaled)
