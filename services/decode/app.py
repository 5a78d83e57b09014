"""Wiring of a decode process: language model + continuous-batching engine + KV reader behind gRPC."""

from __future__ import annotations

import logging
import os

import grpc

from services.config import EpdConfig
from services.server import RoleServer

logger = logging.getLogger(__name__)


SMALL_BOX_SERIAL_ROWS = 4     # measured on 2 cores (docs/benchmarks.md, "Decode threads")


def serial_rows(configured: int, slots: int, fused: bool = False) -> int:
    """--decode-serial-rows with auto (-1) resolved.  Fused steps: none serial (its one OpenMP region on every
    core beat one thread at 1, 2 and 4 rows in a 2-core cluster, docs/benchmarks.md "Decode threads").
    Unfused steps: up to 4 rows on a box of at most 2 usable cores (there each op's barriers lose to the
    rest of the pipeline waking per token), else one-row steps."""
    if configured >= 0:
        return configured
    if fused:
        return 0
    return min(SMALL_BOX_SERIAL_ROWS, slots) if len(os.sched_getaffinity(0)) <= 2 else 1


def bf16_weights(config: EpdConfig) -> bool:
    """--dtype bfloat16 on CPU: decode keeps float32 activations and KV over bfloat16 weights.

    A decode step reads every weight once for a few rows, so it is bound by the weights' bytes: bfloat16
    panels (widened exactly in registers, services/kernels/panel.c) halve them, while bfloat16
    activations would only add rounding (and oneDNN's bf16 GEMMs lose to the panels at a few rows).  The
    prefilled bfloat16 KV is widened in its one copy into decode's blocks.  Needs the panel kernel."""
    import torch

    from services.models import panel_linear

    return (config.dtype == "bfloat16" and config.device == "cpu" and config.linear_kernel != "default"
            and panel_linear.available(torch.bfloat16))


def load_dtype(config: EpdConfig) -> str:
    """The dtype decode loads its language model in (float32 under bfloat16 weights: bf16_weights)."""
    return "float32" if bf16_weights(config) else config.dtype


def wants_fused(config: EpdConfig) -> bool:
    """The fused step may run (services/decode/fused.py decides at start-up whether the model fits it)."""
    from services.models import panel_linear

    return (config.decode_fused != "off" and config.device == "cpu"
            and load_dtype(config) == "float32" and panel_linear.available())


def stack_kernel(config: EpdConfig) -> str:
    """The decoder stack's --linear-kernel: auto becomes panel where the fused step will want it
    (services/decode/fused.py needs panel layers; fused with panels beats every unfused kernel)."""
    if config.linear_kernel == "auto" and wants_fused(config):
        return "panel"
    return config.linear_kernel


async def build(config: EpdConfig) -> RoleServer:
    import torch

    from services.connectors.wiring import open_store
    from services.models.head_screen import screen_head_mode
    from services.models.prepack import export, prepack_language
    from services.models.processing import load_tokenizer
    from services.models.registry import adapter_for, resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc

    from .engine import DecodeEngine
    from .servicer import DecodeServicer
    from .serving import DecodeService

    path = resolve_model(config.model)
    lm = adapter_for(path).load_language(path, config.device, load_dtype(config), config.max_model_len)
    steps = (1, config.decode_slots) if config.decode_slots > 1 else (1,)   # the rows a decode step multiplies
    serial = serial_rows(config.decode_serial_rows, config.decode_slots)
    fused_serial = serial_rows(config.decode_serial_rows, config.decode_slots, fused=True)
    export(prepack_language(lm, config.linear_kernel, rows=steps, head_rows=steps,
                            serial_rows=fused_serial if wants_fused(config) else serial,
                            stack_mode=stack_kernel(config),
                            head_mode=screen_head_mode(config.linear_kernel, config.lm_head_screen),
                            weight_dtype=torch.bfloat16 if bf16_weights(config) else None), "language")
    engine = DecodeEngine(lm, load_tokenizer(path), config.decode_slots, config.max_model_len,
                          max_queued=config.decode_queue, stream_timeout=config.request_timeout_s,
                          kv_cache_bytes=config.kv_cache_mb << 20, block_size=config.kv_block_size,
                          attention=config.decode_attention, serial_rows=serial, fused=config.decode_fused,
                          fused_serial_rows=fused_serial,
                          lm_head_screen=config.lm_head_screen)
    logger.info("decode engine: %s", engine.describe())
    kv_store = open_store(config, "kv", producer=False)
    service = DecodeService(engine, kv_store, kv_wait_s=config.decode_kv_wait_s)
    servicer = DecodeServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_DecodeServiceServicer_to_server(servicer, server)

    def cleanup() -> None:
        engine.close()
        kv_store.close()

    from services.openai_calls import render_client
    from services.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "decode", config.served_model_id())  # what llm-d scrapes
    http = routes(service, config.served_model_id(), render_client(config))
    return RoleServer(name="decode", register_grpc=register, cleanup=cleanup, http_routes=http, stores=[kv_store])
