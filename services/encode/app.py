"""Wiring of an encode process: vision tower + batching engine + EC store behind gRPC."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from services.config import EpdConfig
from services.runtime.server import RoleServer

if TYPE_CHECKING:
    from services.models.device_plan import DevicePlan
    from services.models.prepack import LinearReport


def prepare(vision: Any, plan: DevicePlan) -> LinearReport:
    """The vision tower's CPU kernels where the plan has them (none on CUDA: services/models/device_plan.py)."""
    from services.models.prepack import prepack_vision

    return prepack_vision(vision, plan.linear_kernel, fuse=plan.fused_kernels)


async def build(config: EpdConfig) -> RoleServer:
    from services.connectors.wiring import open_store
    from services.models.device_plan import plan_for
    from services.models.prepack import export
    from services.models.registry import adapter_for, resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc

    from .engine import EncodeEngine
    from .servicer import EncodeServicer
    from .serving import EncodeService

    plan = plan_for(config)   # what runs on this device (CPU-only kernels never on CUDA)
    path = resolve_model(config.checkpoint.model)
    vision = adapter_for(path).load_vision(path, config.checkpoint.device, config.checkpoint.dtype)
    export(prepare(vision, plan), "vision")
    engine = EncodeEngine(vision, config.engines.encode_max_batch_tokens)
    store = open_store(config, "ec")
    mm_store = open_store(config, "mm", producer=False)  # render's processed images, read by handle
    service = EncodeService(engine, store, config.checkpoint.served_model_id(), config.limits.request_timeout_s,
                            config.engines.encode_max_queue, mm_store)
    servicer = EncodeServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_EncodeServiceServicer_to_server(servicer, server)

    def cleanup() -> None:
        engine.close()
        store.close()
        mm_store.close()

    from services.edge.openai_calls import render_client
    from services.observability.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "encode", config.checkpoint.served_model_id())  # what llm-d scrapes
    return RoleServer(name="encode", register_grpc=register, cleanup=cleanup,
                      http_routes=routes(service, render_client(config)),
                      stores=[store, mm_store])
