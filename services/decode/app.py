"""Wiring of a decode process: language model + continuous-batching engine + KV reader behind gRPC."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from services.config import EpdConfig
from services.models.context import context_length
from services.models.device_plan import plan_for
from services.runtime.server import RoleServer

if TYPE_CHECKING:
    from services.models.device_plan import DevicePlan
    from services.models.prepack import LinearReport
    from services.weights.role import RoleWeights

    from .engine import DecodeEngine
    from .serving import DecodeService

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


def gpu_kv_bytes(config: EpdConfig, lm: object) -> int:
    """CUDA: decode's KV pool from the GPU budget the roles on this GPU share (services/decode/gpu_budget.py), read off
    the device now that the model is loaded (decode starts last under `epd serve`)."""
    import torch

    from services.decode.block_pool import block_bytes
    from services.decode.gpu_budget import decode_pool_bytes, ipc_reserve, pool_blocks, step_workspace

    layout, text = lm.layout, lm.model.config   # type: ignore[attr-defined]
    free, total = torch.cuda.mem_get_info(torch.device(config.checkpoint.device))
    block = block_bytes(layout, config.engines.kv_block_size)
    hidden = int(lm.hidden_size)   # type: ignore[attr-defined]
    workspace = step_workspace(config.engines.decode_slots, hidden, int(getattr(text, "intermediate_size", 4 * hidden)),
                               int(lm.vocab_size), layout.dtype.itemsize, free // block)   # type: ignore[attr-defined]
    stores = config.stores
    reserve = workspace + ipc_reserve(stores.ec_connector, stores.kv_connector, stores.ec_capacity_mb,
                                      stores.kv_capacity_mb)
    min_pool = (-(-config.checkpoint.max_model_len // config.engines.kv_block_size) + 1) * block
    budget = decode_pool_bytes(total, free, config.engines.gpu_memory_fraction, reserve, min_pool)
    blocks = pool_blocks(budget.pool, block, config.engines.kv_block_size, layout.num_kv_heads, layout.head_dim)
    logger.info("decode %s: %d blocks of %d tokens", budget.line(), blocks, config.engines.kv_block_size)
    return blocks * block


def bf16_weights(config: EpdConfig) -> bool:
    """--dtype bfloat16 on CPU: decode keeps float32 activations and KV over bfloat16 weights.

    A decode step reads every weight once for a few rows, so it is bound by the weights' bytes: bfloat16
    panels (widened exactly in registers, services/kernels/panel.c) halve them, while bfloat16
    activations would only add rounding (and oneDNN's bf16 GEMMs lose to the panels at a few rows).  The
    prefilled bfloat16 KV is widened in its one copy into decode's blocks.  Needs the panel kernel."""
    import torch

    from services.models import panel_linear

    return (config.checkpoint.dtype == "bfloat16" and plan_for(config).cpu and config.engines.linear_kernel != "default"
            and panel_linear.available(torch.bfloat16))


def load_dtype(config: EpdConfig) -> str:
    """The dtype decode loads its language model in (float32 under bfloat16 weights: bf16_weights)."""
    return "float32" if bf16_weights(config) else config.checkpoint.dtype


def wants_fused(config: EpdConfig) -> bool:
    """The fused step may run (services/decode/fused.py decides at start-up whether the model fits it)."""
    from services.models import panel_linear

    return (config.engines.decode_fused != "off" and plan_for(config).cpu
            and load_dtype(config) == "float32" and panel_linear.available())


def stack_kernel(config: EpdConfig) -> str:
    """The decoder stack's --linear-kernel: auto becomes panel where the fused step will want it
    (services/decode/fused.py needs panel layers; fused with panels beats every unfused kernel)."""
    if config.engines.linear_kernel == "auto" and wants_fused(config):
        return "panel"
    return config.engines.linear_kernel


def prepare(lm: Any, config: EpdConfig, plan: DevicePlan) -> LinearReport:
    """The language model's CPU kernels where the plan has them (none on CUDA: services/models/device_plan.py)."""
    import torch

    from services.models.head_screen import screen_head_mode
    from services.models.prepack import prepack_language

    slots = config.engines.decode_slots
    steps = (1, slots) if slots > 1 else (1,)   # the rows a decode step multiplies
    serial = serial_rows(config.engines.decode_serial_rows, config.engines.decode_slots, fused=wants_fused(config))
    return prepack_language(lm, plan.linear_kernel, rows=steps, head_rows=steps, serial_rows=serial,
                            stack_mode=stack_kernel(config) if plan.cpu else None,
                            head_mode=screen_head_mode(plan.linear_kernel, plan.lm_head_screen, lm.lm_head),
                            weight_dtype=torch.bfloat16 if bf16_weights(config) else None)


def load_engine(config: EpdConfig, folder: Path, tokenizer_folder: Path) -> DecodeEngine:
    """The language model of checkpoint `folder`, its kernels and a decode engine over it (start-up, and each
    weight version staged by a weight update: services/weights/role.py)."""
    from services.models.prepack import export
    from services.models.processing import load_tokenizer
    from services.models.registry import adapter_for

    from .engine import DecodeEngine

    plan = plan_for(config)   # what runs on this device (CPU-only kernels never on CUDA)
    engines = config.engines
    max_len = context_length(config.checkpoint.max_model_len, folder)
    lm = adapter_for(folder).load_language(folder, config.checkpoint.device, load_dtype(config), max_len)
    serial = serial_rows(engines.decode_serial_rows, engines.decode_slots)
    fused_serial = serial_rows(engines.decode_serial_rows, engines.decode_slots, fused=True)
    export(prepare(lm, config, plan), "language")
    return DecodeEngine(lm, load_tokenizer(tokenizer_folder), engines.decode_slots, max_len,
                        max_queued=engines.decode_queue, stream_timeout=config.limits.request_timeout_s,
                        kv_cache_bytes=engines.kv_cache_mb << 20 if plan.cpu else gpu_kv_bytes(config, lm),
                        block_size=engines.kv_block_size, attention=plan.decode_attention,
                        serial_rows=serial, fused=plan.decode_fused, fused_serial_rows=fused_serial,
                        lm_head_screen=plan.lm_head_screen, logprobs_mode=engines.logprobs_mode)


def weights_of(config: EpdConfig, service: DecodeService, base: Path) -> RoleWeights:
    """The decode instance's weights: each version an engine of its own; a replaced one finishes its requests."""
    from services.weights.role import RoleWeights, retire_when_idle

    def swap(engine: DecodeEngine) -> DecodeEngine:
        old, service.engine = service.engine, engine
        service.retiring.append(old)
        return old

    def retire(engine: DecodeEngine) -> None:
        def gone() -> None:
            if engine in service.retiring:
                service.retiring.remove(engine)
            engine.close()

        retire_when_idle("decode", lambda: not engine.busy, gone, config.limits.max_request_timeout_s)

    return RoleWeights("decode", base, lambda folder, _version: load_engine(config, folder, base), swap, retire)


async def build(config: EpdConfig) -> RoleServer:
    from services.connectors.wiring import open_store
    from services.models.registry import resolve_model
    from services.rpc.v1 import epd_pb2_grpc as rpc
    from services.weights import servicer as weights_rpc

    from .servicer import DecodeServicer
    from .serving import DecodeService

    path = resolve_model(config.checkpoint.model)
    engine = load_engine(config, path, path)
    logger.info("decode engine: %s", engine.describe())
    kv_store = open_store(config, "kv", producer=False)
    service = DecodeService(engine, kv_store, kv_wait_s=config.engines.decode_kv_wait_s)
    weights = service.weights = weights_of(config, service, path)
    servicer = DecodeServicer(service)

    def register(server: grpc.aio.Server) -> None:
        rpc.add_DecodeServiceServicer_to_server(servicer, server)
        weights_rpc.register(server, weights)

    def cleanup() -> None:
        service.engine.close()
        for old in list(service.retiring):
            old.close()
        kv_store.close()

    from services.edge.openai_calls import render_client
    from services.observability.vllm_metrics import VllmGauges

    from .api_router import routes

    VllmGauges(service, "decode", config.checkpoint.served_model_id())  # what llm-d scrapes
    http = routes(service, config.checkpoint.served_model_id(), render_client(config))
    return RoleServer(name="decode", register_grpc=register, cleanup=cleanup, http_routes=http, stores=[kv_store])
