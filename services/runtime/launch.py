"""`epd serve`: the whole cluster on one machine, one OS process per role instance.

Starts render, encode×N, prefill×N, decode×N and the coordinator, waits until
every one is ready (GET /ready: its stores answer; the coordinator's: every
role has a ready instance; bounded), prints one ready line with the URL and a
curl example, and on Ctrl-C / SIGTERM drains: the coordinator first (it
refuses new requests and lets running ones finish within --shutdown-grace-s),
then the roles; SIGKILL only past the grace period.  Shared-memory segments
left behind are removed.  The children run in their own sessions (Ctrl-C
reaches only this process, which stops them in order) and get SIGTERM if this
process dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from services.config import EpdConfig
from services.models.device_plan import plan_for
from services.runtime.demo_request import curl_example
from services.runtime.server import free_port

STARTUP_TIMEOUT_S = 300.0
# The coordinator loads no model (~1 s idle), but a fresh install compiles its imports and a loaded 2-core box
# once took over 60 s to bring it up.
COORDINATOR_READY_TIMEOUT_S = 180.0
STOP_MARGIN_S = 5.0             # past the grace period, before SIGKILL
SHOW_PROBLEMS_AFTER_S = 5.0     # a role not ready this long: say why while waiting
PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    role: str
    instance_id: str
    grpc_port: int
    http_port: int
    process: subprocess.Popen | None = None
    ready_path: str = "/ready"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def plan(config: EpdConfig, has_vision: bool = True) -> list[Child]:
    # A text-only model has no encode stage: no encoder is started, the coordinator gets none.
    counts = {"render": 1, "encode": config.cluster.encode_instances if has_vision else 0,
              "prefill": config.cluster.prefill_instances, "decode": config.cluster.decode_instances}
    server = config.server
    return [Child(role, f"{server.instance_id}_{role}{i}", free_port(server.host), free_port(server.host))
            for role, n in counts.items() for i in range(n)]


def _urls(children: list[Child], role: str) -> str:
    return ",".join(c.grpc_address for c in children if c.role == role)


def _http_urls(children: list[Child], role: str, host: str) -> str:
    return ",".join(f"http://{host}:{c.http_port}" for c in children if c.role == role)


def coordinator_child(config: EpdConfig, children: list[Child]) -> Child:
    return Child("coordinator", f"{config.server.instance_id}_coordinator", 0, config.server.port)


def spawn(child: Child, config: EpdConfig, extra_env: dict[str, str]) -> None:
    env = {**os.environ, **config.to_env(), **extra_env, "EPD_INSTANCE_ID": child.instance_id, "EPD_SERVE_CHILD": "1",
           "EPD_GRPC_PORT": str(child.grpc_port), "EPD_HTTP_PORT": str(child.http_port)}
    child.process = subprocess.Popen([sys.executable, "-m", "services.runtime.cli", child.role], env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """In the child: SIGTERM when `epd serve` dies, however it dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def readiness(host: str, port: int, path: str = "/ready", instance_id: str = "") -> tuple[bool, list[str]]:
    """(ready, problems) from a process's readiness endpoint; not answering is not ready, nor is a 200 that
    names another instance than `instance_id` (when given): another server holds that port."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=2.0) as reply:
            if instance_id:
                try:
                    said = json.loads(reply.read() or b"{}").get("instance_id")
                except (ValueError, AttributeError):
                    said = None
                if said != instance_id:
                    return False, [f"port {port} answered for another instance ({said!r}), not {instance_id}"]
            return reply.status == 200, []
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return False, [str(p) for p in body.get("problems", [])] or [f"{path} answered {exc.code}"]
    except OSError:
        return False, ["not answering yet"]


def wait_ready(children: list[Child], host: str, deadline: float) -> None:
    pending = list(children)
    started, shown = time.monotonic(), dict[str, list[str]]()
    while pending:
        for child in list(pending):
            assert child.process is not None
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.role} ({child.instance_id}) exited with {child.process.returncode}")
            ready, problems = readiness(host, child.http_port, child.ready_path,
                                        child.instance_id if child.role == "coordinator" else "")
            if ready:
                pending.remove(child)
            elif time.monotonic() - started > SHOW_PROBLEMS_AFTER_S and shown.get(child.instance_id) != problems:
                shown[child.instance_id] = problems
                print(f"epd serve: waiting for {child.role} ({child.instance_id}): {'; '.join(problems)}",
                      flush=True)
        if time.monotonic() > deadline:
            raise RuntimeError("not ready in time: " + ", ".join(f"{c.role} ({'; '.join(shown.get(c.instance_id, []))})"
                                                                for c in pending))
        time.sleep(0.2)


def _stop(processes: list[subprocess.Popen], timeout_s: float) -> None:
    for proc in processes:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"epd serve: pid {proc.pid} still running after {timeout_s:g} s: killing it", flush=True)
            proc.kill()
            proc.wait(timeout=5)


def stop_all(children: list[Child], grace_s: float = 0.0) -> None:
    """The coordinator first (it drains running requests within `grace_s`), then every role."""
    def live(roles: bool) -> list[subprocess.Popen]:
        return [c.process for c in children if c.process is not None and c.process.poll() is None
                and (c.role != "coordinator") == roles]

    front = live(roles=False)
    if front:
        print(f"epd serve: stopping: the coordinator refuses new requests and lets running ones finish "
              f"(up to {grace_s:g} s)", flush=True)
        _stop(front, grace_s + STOP_MARGIN_S)
    back = live(roles=True)
    if back:
        print(f"epd serve: stopping {len(back)} role processes", flush=True)
        _stop(back, grace_s + STOP_MARGIN_S)


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
    url = f"http://{config.server.host}:{config.server.port}"
    roles = "; ".join(f"{c.role} http://{config.server.host}:{c.http_port} grpc {c.grpc_address}"
                      for c in children if c.role != "coordinator")
    admin = f"admin http://{config.security.admin_host}:{config.security.admin_port}"
    print(f"epd ready: {url} (model {config.checkpoint.served_model_id()}) — {roles}; {admin}", flush=True)
    served = config.checkpoint.served_model_id()
    print("try:\n" + curl_example(url, served, has_vision, bool(config.security.api_key)), flush=True)


def long_prefill_env(config: EpdConfig, children: list[Child]) -> dict[str, dict[str, str]]:
    """The flag board through which decode follows prefill's long prompts (services/hostcpu/role_cpu.py): created in
    /dev/shm under this cluster's instance id (remove_segments removes it), a byte per prefill instance."""
    from services.hostcpu.role_cpu import LONG_BOARD_BYTES, LONG_BOARD_ENV, LONG_SLOT_ENV, create_long_board

    prefills = [c for c in children if c.role == "prefill"]
    if not os.path.isdir("/dev/shm") or not prefills or len(prefills) > LONG_BOARD_BYTES:
        return {}
    path = create_long_board(os.path.join("/dev/shm", f"epd-long-{config.server.instance_id}"))
    env = {c.instance_id: {LONG_BOARD_ENV: path} for c in children if c.role == "decode"}
    env.update({c.instance_id: {LONG_BOARD_ENV: path, LONG_SLOT_ENV: str(slot)} for slot, c in enumerate(prefills)})
    return env


def compute_lease_env(config: EpdConfig, children: list[Child]) -> dict[str, dict[str, str]]:
    """The compute lease encode and prefill take turns on and decode's steps yield to (compute_lease.py, --compute-lease
    auto): one in /dev/shm under this cluster's instance id (remove_segments removes it), a flag per prompt-side
    process; decode processes get its path without a slot (they follow it, never take it)."""
    from services.hostcpu import compute_lease

    takers = [c for c in children if c.role in ("encode", "prefill")]
    followers = [c for c in children if c.role == "decode"]
    if (config.cpu.compute_lease != "auto" or not os.path.isdir("/dev/shm") or not takers
            or len(takers) + len(followers) < 2 or len(takers) > compute_lease.BOARD_BYTES):
        return {}
    path = compute_lease.create(os.path.join("/dev/shm", f"epd-lease-{config.server.instance_id}"))
    env = {c.instance_id: {compute_lease.LEASE_ENV: path, compute_lease.SLOT_ENV: str(slot)}
           for slot, c in enumerate(takers)}
    env.update({c.instance_id: {compute_lease.LEASE_ENV: path} for c in followers})
    return env


def start_order(config: EpdConfig, roles: list[Child]) -> list[list[Child]]:
    """The roles in the batches they start in (each ready before the next starts).  On CUDA decode starts last:
    its KV pool is what the GPU budget leaves once every other role on the GPU has loaded
    (services/decode/gpu_budget.py).  On CPU all at once."""
    if plan_for(config).cpu:
        return [roles]
    return [[c for c in roles if c.role != "decode"], [c for c in roles if c.role == "decode"]]


def serve(config: EpdConfig) -> int:
    from services.connectors.registry import sweep_stale_segments
    from services.models.registry import adapter_for, resolve_model

    sweep_stale_segments()
    config = config.with_(admin_port=config.security.admin_port or free_port(config.security.admin_host))
    model_path = str(resolve_model(config.checkpoint.model))  # builds the demo checkpoint once, before the children
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
        # encode, prefill and decode render llm-d's OpenAI-format calls on the render instance
        renders = {"EPD_OPENAI_RENDER_URLS": _http_urls(roles, "render", config.server.host)}
        served_id = config.checkpoint.served_model_id()
        cpu = plan_for(config).cpu_knobs   # the CPU roles' boards; none on CUDA (services/models/device_plan.py)
        long_board = long_prefill_env(config, roles) if cpu else {}
        lease = compute_lease_env(config, roles) if cpu else {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for batch in start_order(config, roles):
            for child in batch:
                extra = {**(renders if child.role != "render" else {}), **long_board.get(child.instance_id, {}),
                         **lease.get(child.instance_id, {})}
                spawn(child, config, {"EPD_MODEL": model_path, "EPD_SERVED_MODEL_NAME": served_id, **extra})
            wait_ready(batch, config.server.host, deadline)
        spawn(coordinator, config, {"EPD_MODEL": model_path, "EPD_SERVED_MODEL_NAME": served_id,
                                    **{f"EPD_{r.upper()}_URLS": _urls(roles, r)
                                       for r in ("render", "encode", "prefill", "decode")},
                                    **{f"EPD_{r.upper()}_HTTP_URLS": _http_urls(roles, r, config.server.host)
                                       for r in ("render", "encode", "prefill", "decode")}})
        # ready only when /ready names this coordinator: another server on the port would answer otherwise
        wait_ready([coordinator], config.server.host, time.monotonic() + COORDINATOR_READY_TIMEOUT_S)
        print_ready(config, children, has_vision)
        while not stopping["now"]:
            time.sleep(0.2)
        return 0
    except RuntimeError as exc:
        print(f"epd serve: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(children, config.server.shutdown_grace_s)
        remove_segments(config.server.instance_id)
        print("epd serve: stopped", flush=True)
