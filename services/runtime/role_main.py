"""Entry point of one role process: build the role, then serve gRPC + HTTP until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import sys

from services.config import EpdConfig
from services.observability import setup_logging
from services.runtime import event_loop
from services.runtime.heap import startup_done
from services.runtime.server import free_port

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
    gc.disable()   # until start-up is over (services/runtime/heap.py: startup_done)
    setup_logging(role, config.server.instance_id, config.server.log_level)
    from services.kernels.loader import configure

    configure(config.engines.kernels_off, config.engines.cpu_features_off)   # before any kernel loads
    if role in ("encode", "prefill", "decode"):
        from services.models.device_plan import plan_for

        if plan_for(config).cpu_knobs:   # threads, OpenMP, niceness, compute lease: CPU roles only
            from services.hostcpu.role_cpu import apply

            apply(config, role)  # before torch is imported: the OpenMP runtime reads its environment at load
    if role == "coordinator":
        from coordinator.main import run_coordinator

        return run_coordinator(config)
    if role == "render":
        from services.runtime.heap import keep_freed_memory

        keep_freed_memory()  # before any thread takes an arena of its own (services/runtime/heap.py)
        # transformers imports torch whenever it is installed; render needs none of it (PIL processors).
        sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
        # ...and then says "PyTorch was not found" (twice): expected here, so not said.
        logging.getLogger("transformers").addFilter(_NoTorchExpected())
    from services.connectors.registry import sweep_stale_segments

    sweep_stale_segments()  # a restarted container's old pools (owners are dead; live owners hold a lock)
    grpc_port = config.server.grpc_port or free_port(config.server.host)
    http_port = config.server.http_port or free_port(config.server.host)
    module = importlib.import_module(ROLE_MODULES[role])
    from services.kernels.loader import report

    report(role)   # which variant of each of the role's kernels runs: the start-up log and epd_kernel_info
    from services.rpc.tls import server_credentials
    from services.runtime.server import serve

    async def main() -> None:
        from services.runtime.announce import start_announcing

        if role in ("encode", "prefill", "decode"):
            from services.hostcpu import compute_threads

            compute_threads.single()   # the main thread and `to_thread` helpers: one torch thread each
            asyncio.get_running_loop().set_default_executor(compute_threads.helper_executor())

        role_server = await module.build(config)
        # Everything loaded so far (torch, transformers, the model) lives as long as the process: keep the
        # cyclic GC from rescanning it, in every full collection and once more at exit (seconds of CPU here).
        startup_done()
        announcer = start_announcing(config, role, grpc_port, http_port)
        try:
            server = config.server
            await serve(role_server, server.host, grpc_port, http_port, server.log_level, server.shutdown_grace_s,
                        keys=config.security.role_api_keys(), grpc_host=server.grpc_host,
                        tls=server_credentials(config), fast_lane=server.fast_lane, instance_id=server.instance_id)
        finally:
            if announcer is not None:
                await announcer.stop()

    event_loop.run(main(), config.server.event_loop)
    return 0
