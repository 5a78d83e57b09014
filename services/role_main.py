"""Entry point of one role process: build the role, then serve gRPC + HTTP until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import sys

from . import event_loop
from .config import EpdConfig
from .observability import setup_logging
from .server import free_port

log = logging.getLogger(__name__)

ROLE_MODULES = {
    "render": "services.render.app",
    "encode": "services.encode.app",
    "prefill": "services.prefill.app",
    "decode": "services.decode.app",
}


class _NoTorchExpected(logging.Filter):
    """Drops transformers' advice that torch is missing, in render, which blocks torch on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return NO_TORCH_MESSAGE not in record.getMessage()


NO_TORCH_MESSAGE = "PyTorch was not found"


def run(role: str, config: EpdConfig) -> int:
    setup_logging(role, config.instance_id, config.log_level)
    if role in ("encode", "prefill", "decode"):
        from .role_cpu import apply

        apply(config, role)  # before torch is imported: the OpenMP runtime reads its environment at load
    if role == "coordinator":
        from coordinator.main import run_coordinator

        return run_coordinator(config)
    if role == "render":
        from .heap import keep_freed_memory

        keep_freed_memory()  # before any thread takes an arena of its own (services/heap.py)
        # transformers imports torch whenever it is installed; render needs none of it (PIL processors).
        sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
        # ...and then says "PyTorch was not found" (twice): expected here, so not said.
        logging.getLogger("transformers").addFilter(_NoTorchExpected())
    from .connectors.registry import sweep_stale_segments

    sweep_stale_segments()  # a restarted container's old pools (owners are dead; live owners hold a lock)
    grpc_port = config.grpc_port or free_port(config.host)
    http_port = config.http_port or free_port(config.host)
    module = importlib.import_module(ROLE_MODULES[role])
    from .grpc_tls import server_credentials
    from .server import serve

    async def main() -> None:
        from .announce import start_announcing

        if role in ("encode", "prefill", "decode"):
            from . import compute_threads

            compute_threads.single()   # the main thread and `to_thread` helpers: one torch thread each
            asyncio.get_running_loop().set_default_executor(compute_threads.helper_executor())

        role_server = await module.build(config)
        # Everything loaded so far (torch, transformers, the model) lives as long as the process: keep the
        # cyclic GC from rescanning it, in every full collection and once more at exit (seconds of CPU here).
        gc.freeze()
        announcer = start_announcing(config, role, grpc_port, http_port)
        try:
            await serve(role_server, config.host, grpc_port, http_port, config.log_level, config.shutdown_grace_s,
                        keys=config.role_api_keys(), grpc_host=config.grpc_host, tls=server_credentials(config),
                        fast_lane=config.fast_lane, instance_id=config.instance_id)
        finally:
            if announcer is not None:
                await announcer.stop()

    event_loop.run(main(), config.event_loop)
    return 0
