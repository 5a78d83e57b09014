"""The coordinator's view of the cluster: one pool per role, the EC handle cache, the mm store, metrics.

The mm store (the EC connector's backend, torch-free) holds the tensors of
features posted to /inference/v1/generate, so they travel to encode by
handle like rendered images; its shm pool is only made on the first such put.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc

from services.config import EpdConfig
from services.connectors.base import TensorStore
from services.connectors.wiring import open_store
from services.grpc_tls import channel_credentials, channel_options
from services.owned_metrics import OwnedGauges
from services.rpc.v1 import epd_pb2_grpc as rpc

from .clients import EncodeClient, PrefillClient, RenderClient
from .decode_stream import DecodeClient
from .metrics import CoordinatorMetrics
from .routing.pool import InstancePool


class HandleCache:
    """Bounded LRU of mm_hash -> EC handle (JSON bytes) the encoders returned."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, bytes] = OrderedDict()

    def get(self, mm_hash: str) -> bytes | None:
        handle = self._entries.get(mm_hash)
        if handle is not None:
            self._entries.move_to_end(mm_hash)
        return handle

    def put(self, mm_hash: str, handle: bytes) -> None:
        self._entries[mm_hash] = handle
        self._entries.move_to_end(mm_hash)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def pop(self, mm_hash: str) -> None:
        self._entries.pop(mm_hash, None)

    def __len__(self) -> int:
        return len(self._entries)


GAUGES = {
    "epd_mm_store_bytes": ("Bytes of posted features' tensors the coordinator's mm store holds",
                           lambda c: c.mm_store.stats().bytes_used),
    "epd_mm_store_bytes_copied_total": ("Payload bytes the coordinator's mm store copied (each posted item's "
                                        "tensors, once)", lambda c: c.mm_store.stats().bytes_copied),
}


class Cluster:
    def __init__(self, config: EpdConfig, metrics: CoordinatorMetrics | None = None) -> None:
        self.config = config
        self.ec_handles = HandleCache()
        self.metrics = metrics if metrics is not None else CoordinatorMetrics()  # tests pass their own registry
        self.mm_store: TensorStore | None = None

    @property
    def pools(self) -> list[InstancePool]:
        return [self.render.pool, self.encode.pool, self.prefill.pool, self.decode.pool]

    def start(self) -> None:
        """Connect the pools behind each role's typed client; must run inside the serving event loop (grpc.aio
        channels bind to it)."""
        self.render = RenderClient(self._pool("render", rpc.RenderServiceStub))
        self.encode = EncodeClient(self._pool("encode", rpc.EncodeServiceStub))
        self.prefill = PrefillClient(self._pool("prefill", rpc.PrefillServiceStub))
        self.decode = DecodeClient(self._pool("decode", rpc.DecodeServiceStub))
        for pool in self.pools:
            pool.start_probing()
        self.mm_store = open_store(self.config, "mm", producer=False)
        self.gauges = OwnedGauges(self, GAUGES)

    def _pool(self, role: str, stub: Callable[[grpc.aio.Channel], Any]) -> InstancePool:
        config = self.config
        return InstancePool(role, config.urls(role), stub, policy=getattr(config, f"{role}_routing_policy"),
                            http_urls=config.http_urls(role), metrics=self.metrics,
                            forget_after_s=config.instance_forget_after_s,
                            credentials=channel_credentials(config), channel_options=channel_options(config),
                            fast_lane=config.fast_lane)

    def pool(self, role: str) -> InstancePool:
        """The pool of `role` (render, encode, prefill, decode)."""
        return {p.role: p for p in self.pools}[role]

    async def close(self) -> None:
        for pool in self.pools:
            await pool.close()
        if self.mm_store is not None:
            self.mm_store.close()
