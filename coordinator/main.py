"""Runs the coordinator process: the public app on --host/--port and the admin app on --admin-host/--admin-port.

One event loop serves both (they share the cluster and the in-flight
registry).  The public server owns SIGTERM/SIGINT and drains
(coordinator.drain); the admin server stops once the public one has.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Iterator

import uvicorn

from services.config import EpdConfig

from .app import CoordinatorApp
from .drain import DrainingServer

log = logging.getLogger(__name__)
AFTER_DRAIN_S = 2  # uvicorn's own wait for connections once the drain is over (idle keep-alives)


class _AdminServer(uvicorn.Server):
    """The admin server: no signal handling of its own (the public server drains and stops both)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve(public: DrainingServer, admin: _AdminServer, config: EpdConfig) -> None:
    admin_socket = admin.config.bind_socket()
    host, port = admin_socket.getsockname()[:2]
    log.info("coordinator admin API on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    admin_task = asyncio.create_task(admin.serve(sockets=[admin_socket]))
    try:
        await public.serve()
    finally:
        admin.should_exit = True
        await asyncio.wait({admin_task}, timeout=AFTER_DRAIN_S + 1)


def keep_freed_memory() -> bool:
    """glibc keeps what the coordinator frees for its next request instead of handing it back to the kernel.

    A 20 MB features request makes ~84 MB of short-lived buffers (the body, its long string, the decoded
    base64, the unpacked tensors).  With glibc's defaults each one came from fresh pages: ~21,000 minor page
    faults per request here, each inside a copy that holds the GIL: where a fault is slow (likely a freshly
    booted VM whose memory the host has not backed yet) one CI run saw the event loop stall ~0.3 s a request.
    One arena, large blocks from the heap (up to 32 MB, glibc's ceiling) and no trimming below 256 MB of free
    heap: later requests reuse pages already faulted in (tests/e2e/test_loop_lag.py).  False where the C
    library has no mallopt (musl)."""
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return all(mallopt(option, value) == 1 for option, value in
               ((m_arena_max, 1), (m_mmap_threshold, 32 << 20), (m_trim_threshold, 256 << 20)))


def run_coordinator(config: EpdConfig) -> int:
    keep_freed_memory()   # before any thread takes an arena of its own
    coordinator = CoordinatorApp(config)
    public = DrainingServer(uvicorn.Config(coordinator.build(), host=config.host, port=config.port,
                                           log_level="warning", timeout_graceful_shutdown=AFTER_DRAIN_S),
                            coordinator.drain)
    admin = _AdminServer(uvicorn.Config(coordinator.build_admin(), host=config.admin_host, port=config.admin_port,
                                        log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    gc.freeze()  # what start-up built lives as long as the process: no full collection rescans it (as the roles)
    asyncio.run(_serve(public, admin, config))
    return 0 if public.started else 1
