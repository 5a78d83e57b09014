"""Wiring of a prefill process: language model + engine + EC reader + KV store behind gRPC."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from services.config import EpdConfig
from services.models.context import context_length
from services.runtime.server import RoleServer

if TYPE_CHECKING:
    from services.models.device_plan import DevicePlan
    from services.models.prepack import LinearReport
    from services.weights.role import RoleWeights

    from .serving import PrefillModel, PrefillService

logger = logging.getLogger(__name__)


def prepare(lm: Any, plan: DevicePlan) -> LinearReport:
    """The language model's CPU kernels where the plan has them (none on CUDA: services/models/device_plan.py)."""
    from services.models.head_screen import screen_head_mode
    from services.models.prepack import prepack_language

    # prompts, not single rows, go through prefill's layers (its LM head sees one row per prompt)
    return prepack_language(lm, plan.linear_kernel, rows=(256, 1024), head_rows=(1, 16), fuse=plan.fused_kernels,
                            head_mode=screen_head_mode(plan.linear_kernel, plan.lm_head_screen, lm.lm_head))


def load_model(config: EpdConfig, folder: Path, version: str = "") -> PrefillModel:
    """The language model of checkpoint `folder`, its kernels and a prefill engine over it (start-up, and each
    weight version staged by a weight update: services/weights/role.py)."""
    from services.models.device_plan import plan_for
    from services.models.prepack import export
    from services.models.registry import adapter_for

    from .engine import PrefillEngine
    from .inline_encode import InlineEncoder
    from .serving import PrefillModel

    plan = plan_for(config)   # what runs on this device (CPU-only kernels never on CUDA)
    engines, checkpoint = config.engines, config.checkpoint
    adapter = adapter_for(folder)
    lm = adapter.load_language(folder, checkpoint.device, checkpoint.dtype,
                               context_length(checkpoint.max_model_len, folder))
    export(prepare(lm, plan), "language")
    engine = PrefillEngine(lm, max_num_batched_tokens=engines.max_num_batched_tokens,
                           prefix_cache_mb=engines.prefix_cache_mb, lm_head_screen=plan.lm_head_screen,
                           native_attention=plan.native_attention, cache_scope=version)
    inline = InlineEncoder(adapter, folder, checkpoint.device, checkpoint.dtype) \
        if engines.prefill_inline_encode else None
    return PrefillModel(engine, lm, inline)


def weights_of(config: EpdConfig, service: PrefillService, base: Path) -> RoleWeights:
    """The prefill instance's weights: each version its own model, engine and prefix cache (keyed by version)."""
    from services.weights.role import RoleWeights, retire_when_idle

    def swap(model: PrefillModel) -> PrefillModel:
        old, service.model = service.model, model
        return old

    def retire(model: PrefillModel) -> None:
        retire_when_idle("prefill", lambda: model.engine.num_waiting == 0, model.engine.close,
                         config.limits.max_request_timeout_s)

    return RoleWeights("prefill", base, lambda folder, version: load_model(config, folder, version), swap, retire)


async def build(config: EpdConfig) -> RoleServer:
    from services.connectors.ec import FrameGroupReader
    from services.connectors.wiring import open_store
    from services.models.registry import adapter_for, resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc
    from services.weights import servicer as weights_rpc

    from .servicer import PrefillServicer
    from .serving import PrefillService

    path = resolve_model(config.checkpoint.model)
    model = load_model(config, path)
    logger.info("prefill engine: %s", model.engine.screen_report.line())
    # a video's embeddings come as frame groups (a composite handle): read as one entry
    ec_store = FrameGroupReader(open_store(config, "ec", producer=False))
    kv_store = open_store(config, "kv")
    mm_store = open_store(config, "mm", producer=False) if model.inline is not None else None  # inline items
    model_id = config.checkpoint.served_model_id()
    service = PrefillService(model.engine, model.lm, ec_store, kv_store, config.server.instance_id,
                             config.engines.prefill_max_queue, model.inline, mm_store, path,
                             config.engines.logprobs_mode, model_id=model_id)
    weights = service.weights = weights_of(config, service, path)
    servicer = PrefillServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_PrefillServiceServicer_to_server(servicer, server)
        weights_rpc.register(server, weights)

    def cleanup() -> None:
        service.engine.close()
        kv_store.close()
        ec_store.close()
        if mm_store is not None:
            mm_store.close()

    from services.edge.openai_calls import render_client
    from services.observability.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "prefill", model_id)  # what llm-d scrapes
    http = routes(service, model_id, adapter_for(path).metadata_keys, render_client(config))
    return RoleServer(name="prefill", register_grpc=register, cleanup=cleanup, http_routes=http,
                      stores=[ec_store, kv_store, *([mm_store] if mm_store is not None else [])])
