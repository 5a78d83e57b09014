"""Wiring of a prefill process: language model + engine + EC reader + KV store behind gRPC."""

from __future__ import annotations

import logging

import grpc

from services.config import EpdConfig
from services.server import RoleServer

logger = logging.getLogger(__name__)


async def build(config: EpdConfig) -> RoleServer:
    from services.connectors.ec import FrameGroupReader
    from services.connectors.wiring import open_store
    from services.models import fused_rope
    from services.models.head_screen import screen_head_mode
    from services.models.prepack import export, prepack_language
    from services.models.registry import adapter_for, resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc

    from .engine import PrefillEngine
    from .inline_encode import InlineEncoder
    from .servicer import PrefillServicer
    from .serving import PrefillService

    path = resolve_model(config.model)
    adapter = adapter_for(path)
    lm = adapter.load_language(path, config.device, config.dtype, config.max_model_len)
    # prompts, not single rows, go through prefill's layers (its LM head sees one row per prompt)
    export(prepack_language(lm, config.linear_kernel, rows=(256, 1024), head_rows=(1, 16), fuse=True,
                            head_mode=screen_head_mode(config.linear_kernel, config.lm_head_screen)), "language")
    if config.linear_kernel != "default":   # RoPE in one C pass, transformers' floats (fused_rope.py)
        fused_rope.install()
    engine = PrefillEngine(lm, max_num_batched_tokens=config.max_num_batched_tokens,
                           prefix_cache_mb=config.prefix_cache_mb, lm_head_screen=config.lm_head_screen)
    logger.info("prefill engine: %s", engine.screen_report.line())
    # a video's embeddings come as frame groups (a composite handle): read as one entry
    ec_store = FrameGroupReader(open_store(config, "ec", producer=False))
    kv_store = open_store(config, "kv")
    inline = InlineEncoder(adapter, path, config.device, config.dtype) if config.prefill_inline_encode else None
    mm_store = open_store(config, "mm", producer=False) if inline is not None else None  # inline items by handle
    service = PrefillService(engine, lm, ec_store, kv_store, config.instance_id, config.prefill_max_queue, inline,
                             mm_store)
    servicer = PrefillServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_PrefillServiceServicer_to_server(servicer, server)

    def cleanup() -> None:
        engine.close()
        kv_store.close()
        ec_store.close()
        if mm_store is not None:
            mm_store.close()

    from services.openai_calls import render_client
    from services.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "prefill", config.served_model_id())  # what llm-d scrapes
    http = routes(service, config.served_model_id(), adapter.metadata_keys, render_client(config))
    return RoleServer(name="prefill", register_grpc=register, cleanup=cleanup, http_routes=http,
                      stores=[ec_store, kv_store, *([mm_store] if mm_store is not None else [])])
