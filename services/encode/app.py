"""Wiring of an encode process: vision tower + batching engine + EC store behind gRPC."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from services.config import EpdConfig
from services.runtime.server import RoleServer

if TYPE_CHECKING:
    from services.models.device_plan import DevicePlan
    from services.models.prepack import LinearReport
    from services.weights.role import RoleWeights

    from .engine import EncodeEngine
    from .serving import EncodeService


def prepare(vision: Any, plan: DevicePlan) -> LinearReport:
    """The vision tower's CPU kernels where the plan has them (none on CUDA: services/models/device_plan.py)."""
    from services.models.prepack import prepack_vision

    return prepack_vision(vision, plan.linear_kernel, fuse=plan.fused_kernels)


def load_engine(config: EpdConfig, folder: Path) -> EncodeEngine:
    """The vision tower of checkpoint `folder`, its kernels and an encode engine over it (start-up, and each
    weight version staged by a weight update: services/weights/role.py)."""
    from services.models.device_plan import plan_for
    from services.models.prepack import export
    from services.models.registry import adapter_for

    from .engine import EncodeEngine

    plan = plan_for(config)   # what runs on this device (CPU-only kernels never on CUDA)
    vision = adapter_for(folder).load_vision(folder, config.checkpoint.device, config.checkpoint.dtype)
    export(prepare(vision, plan), "vision")
    return EncodeEngine(vision, config.engines.encode_max_batch_tokens)


def weights_of(config: EpdConfig, service: EncodeService, base: Path) -> RoleWeights:
    """The encode instance's weights: each version a tower and engine of its own; its EC entries keyed by it."""
    from services.weights.role import RoleWeights, retire_when_idle

    def swap(engine: EncodeEngine) -> EncodeEngine:
        old, service.engine = service.engine, engine
        return old

    def retire(engine: EncodeEngine) -> None:
        retire_when_idle("encode", lambda: engine.num_pending == 0, engine.close,
                         config.limits.max_request_timeout_s)

    return RoleWeights("encode", base, lambda folder, _version: load_engine(config, folder), swap, retire)


async def build(config: EpdConfig) -> RoleServer:
    from services.connectors.wiring import open_store
    from services.models.registry import resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc
    from services.weights import servicer as weights_rpc

    from .servicer import EncodeServicer
    from .serving import EncodeService

    path = resolve_model(config.checkpoint.model)
    engine = load_engine(config, path)
    store = open_store(config, "ec")
    mm_store = open_store(config, "mm", producer=False)  # render's processed images, read by handle
    service = EncodeService(engine, store, config.checkpoint.served_model_id(), config.limits.request_timeout_s,
                            config.engines.encode_max_queue, mm_store)
    weights = service.weights = weights_of(config, service, path)
    servicer = EncodeServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_EncodeServiceServicer_to_server(servicer, server)
        weights_rpc.register(server, weights)

    def cleanup() -> None:
        service.engine.close()
        store.close()
        mm_store.close()

    from services.edge.openai_calls import render_client
    from services.observability.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "encode", config.checkpoint.served_model_id())  # what llm-d scrapes
    return RoleServer(name="encode", register_grpc=register, cleanup=cleanup,
                      http_routes=routes(service, render_client(config)),
                      stores=[store, mm_store])
