"""`epd serve`: the whole cluster on one machine, one OS process per role instance.

Starts render, encode×N, prefill×N, decode×N and the coordinator, waits until
every one answers /health (bounded), prints one ready line with the URL and a
curl example, and on Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL
after a grace period) and removes any shared-memory segment left by them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from .config import EpdConfig
from .demo_request import curl_example
from .server import free_port

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0


@dataclass
class Child:
    role: str
    instance_id: str
    grpc_port: int
    http_port: int
    process: subprocess.Popen | None = None

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def plan(config: EpdConfig, has_vision: bool = True) -> list[Child]:
    # A text-only model has no encode stage: no encoder is started, the coordinator gets none.
    counts = {"render": 1, "encode": config.encode_instances if has_vision else 0,
              "prefill": config.prefill_instances, "decode": config.decode_instances}
    return [Child(role, f"{config.instance_id}_{role}{i}", free_port(config.host), free_port(config.host))
            for role, n in counts.items() for i in range(n)]


def _urls(children: list[Child], role: str) -> str:
    return ",".join(c.grpc_address for c in children if c.role == role)


def _http_urls(children: list[Child], role: str, host: str) -> str:
    return ",".join(f"http://{host}:{c.http_port}" for c in children if c.role == role)


def coordinator_child(config: EpdConfig, children: list[Child]) -> Child:
    return Child("coordinator", f"{config.instance_id}_coordinator", 0, config.port)


def spawn(child: Child, config: EpdConfig, extra_env: dict[str, str]) -> None:
    env = {**os.environ, **config.to_env(), **extra_env, "EPD_INSTANCE_ID": child.instance_id,
           "EPD_GRPC_PORT": str(child.grpc_port), "EPD_HTTP_PORT": str(child.http_port)}
    child.process = subprocess.Popen([sys.executable, "-m", "services.cli", child.role], env=env)


def is_healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def wait_healthy(children: list[Child], host: str, deadline: float) -> None:
    pending = list(children)
    while pending:
        for child in list(pending):
            assert child.process is not None
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.role} ({child.instance_id}) exited with {child.process.returncode}")
            if is_healthy(host, child.http_port):
                pending.remove(child)
        if time.monotonic() > deadline:
            raise RuntimeError("not healthy in time: " + ", ".join(c.role for c in pending))
        time.sleep(0.2)


def stop_all(children: list[Child]) -> None:
    live = [c.process for c in children if c.process is not None and c.process.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in live:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def remove_segments(instance_prefix: str) -> list[str]:
    """Unlink shm segments named after our instances (only left if a child was killed)."""
    removed: list[str] = []
    if not os.path.isdir("/dev/shm"):
        return removed
    for name in os.listdir("/dev/shm"):
        if name.startswith("epd") and instance_prefix in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def print_ready(config: EpdConfig, children: list[Child], has_vision: bool = True) -> None:
    url = f"http://{config.host}:{config.port}"
    roles = "; ".join(f"{c.role} http://{config.host}:{c.http_port} grpc {c.grpc_address}"
                      for c in children if c.role != "coordinator")
    print(f"epd ready: {url} (model {config.served_model_id()}) — {roles}", flush=True)
    print("try:\n" + curl_example(url, config.served_model_id(), has_vision), flush=True)


def serve(config: EpdConfig) -> int:
    from .connectors.registry import sweep_stale_segments
    from .models.registry import adapter_for, resolve_model

    sweep_stale_segments()
    model_path = str(resolve_model(config.model))  # builds the demo checkpoint once, before the children
    has_vision = adapter_for(model_path).has_vision()
    roles = plan(config, has_vision)
    coordinator = coordinator_child(config, roles)
    children = [*roles, coordinator]
    stopping = {"now": False}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for child in roles:
            spawn(child, config, {"EPD_MODEL": model_path, "EPD_SERVED_MODEL_NAME": config.served_model_id()})
        wait_healthy(roles, config.host, time.monotonic() + STARTUP_TIMEOUT_S)
        spawn(coordinator, config, {"EPD_SERVED_MODEL_NAME": config.served_model_id(),
                                    **{f"EPD_{r.upper()}_URLS": _urls(roles, r)
                                       for r in ("render", "encode", "prefill", "decode")},
                                    **{f"EPD_{r.upper()}_HTTP_URLS": _http_urls(roles, r, config.host)
                                       for r in ("render", "encode", "prefill", "decode")}})
        wait_healthy([coordinator], config.host, time.monotonic() + 60)
        time.sleep(0.5)  # a coordinator that lost its port to another server exits at once; don't trust that /health
        if coordinator.process is not None and coordinator.process.poll() is not None:
            raise RuntimeError(f"coordinator exited with {coordinator.process.returncode} (port {config.port} taken?)")
        print_ready(config, children, has_vision)
        while not stopping["now"]:
            time.sleep(0.2)
        return 0
    except RuntimeError as exc:
        print(f"epd serve: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(children)
        remove_segments(config.instance_id)
