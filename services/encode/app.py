"""Wiring of an encode process: vision tower + batching engine + EC store behind gRPC."""

from __future__ import annotations

import grpc

from services.config import EpdConfig
from services.server import RoleServer


async def build(config: EpdConfig) -> RoleServer:
    from services.connectors.wiring import open_store
    from services.models.prepack import export, prepack_vision
    from services.models.registry import adapter_for, resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc

    from .engine import EncodeEngine
    from .servicer import EncodeServicer
    from .serving import EncodeService

    path = resolve_model(config.model)
    vision = adapter_for(path).load_vision(path, config.device, config.dtype)
    export(prepack_vision(vision, config.linear_kernel), "vision")
    engine = EncodeEngine(vision, config.encode_max_batch_tokens)
    store = open_store(config, "ec")
    mm_store = open_store(config, "mm", producer=False)  # render's processed images, read by handle
    service = EncodeService(engine, store, config.served_model_id(), config.request_timeout_s,
                            config.encode_max_queue, mm_store)
    servicer = EncodeServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_EncodeServiceServicer_to_server(servicer, server)

    def cleanup() -> None:
        engine.close()
        store.close()
        mm_store.close()

    from services.openai_calls import render_client
    from services.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "encode", config.served_model_id())  # what llm-d scrapes
    return RoleServer(name="encode", register_grpc=register, cleanup=cleanup,
                      http_routes=routes(service, render_client(config)),
                      stores=[store, mm_store])
