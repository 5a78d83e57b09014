"""Wiring of a prefill process: language model + engine + EC reader + KV store behind gRPC."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import grpc

from services.config import EpdConfig
from services.runtime.server import RoleServer

if TYPE_CHECKING:
    from services.models.device_plan import DevicePlan
    from services.models.prepack import LinearReport

logger = logging.getLogger(__name__)


def prepare(lm: Any, plan: DevicePlan) -> LinearReport:
    """The language model's CPU kernels where the plan has them (none on CUDA: services/models/device_plan.py)."""
    from services.models.head_screen import screen_head_mode
    from services.models.prepack import prepack_language

    # prompts, not single rows, go through prefill's layers (its LM head sees one row per prompt)
    return prepack_language(lm, plan.linear_kernel, rows=(256, 1024), head_rows=(1, 16), fuse=plan.fused_kernels,
                            head_mode=screen_head_mode(plan.linear_kernel, plan.lm_head_screen))


async def build(config: EpdConfig) -> RoleServer:
    from services.connectors.wiring import open_store
    from services.models.device_plan import plan_for
    from services.models.prepack import export
    from services.models.registry import adapter_for, resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc

    from .engine import PrefillEngine
    from .inline_encode import InlineEncoder
    from .servicer import PrefillServicer
    from .serving import PrefillService

    plan = plan_for(config)   # what runs on this device (CPU-only kernels never on CUDA)
    engines = config.engines
    path = resolve_model(config.checkpoint.model)
    adapter = adapter_for(path)
    lm = adapter.load_language(path, config.checkpoint.device, config.checkpoint.dtype, config.checkpoint.max_model_len)
    export(prepare(lm, plan), "language")
    engine = PrefillEngine(lm, max_num_batched_tokens=engines.max_num_batched_tokens,
                           prefix_cache_mb=engines.prefix_cache_mb, lm_head_screen=plan.lm_head_screen,
                           native_attention=plan.native_attention)
    logger.info("prefill engine: %s", engine.screen_report.line())
    ec_store = open_store(config, "ec", producer=False)
    kv_store = open_store(config, "kv")
    inline = InlineEncoder(adapter, path, config.checkpoint.device, config.checkpoint.dtype) \
        if engines.prefill_inline_encode else None
    mm_store = open_store(config, "mm", producer=False) if inline is not None else None  # inline items by handle
    service = PrefillService(engine, lm, ec_store, kv_store, config.server.instance_id, engines.prefill_max_queue,
                             inline, mm_store, model_id=config.checkpoint.served_model_id())
    servicer = PrefillServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_PrefillServiceServicer_to_server(servicer, server)

    def cleanup() -> None:
        engine.close()
        kv_store.close()
        ec_store.close()
        if mm_store is not None:
            mm_store.close()

    from services.edge.openai_calls import render_client
    from services.observability.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "prefill", config.checkpoint.served_model_id())  # what llm-d scrapes
    http = routes(service, config.checkpoint.served_model_id(), adapter.metadata_keys, render_client(config))
    return RoleServer(name="prefill", register_grpc=register, cleanup=cleanup, http_routes=http,
                      stores=[ec_store, kv_store, *([mm_store] if mm_store is not None else [])])
