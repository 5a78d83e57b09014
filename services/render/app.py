"""Wiring of a render process: RenderService behind gRPC (and HTTP routes)."""

from __future__ import annotations

import asyncio
import os

import grpc

from services.config import EpdConfig
from services.connectors.wiring import open_store
from services.runtime.server import RoleServer

from .api_router import routes
from .limits import RenderLimits
from .media_policy import MediaPolicy
from .servicer import RenderServicer
from .serving import RenderService


def media_policy(config: EpdConfig) -> MediaPolicy:
    return MediaPolicy(allowed_domains=config.limits.media_domains(),
                       allow_private_networks=config.limits.allow_private_media_urls,
                       timeout_s=config.limits.media_timeout_s, max_bytes=config.limits.max_image_bytes,
                       max_image_pixels=config.limits.max_image_pixels)


def limits(config: EpdConfig) -> RenderLimits:
    lim = config.limits
    return RenderLimits(max_images_per_request=lim.max_images_per_request, max_image_pixels=lim.max_image_pixels,
                        max_image_bytes=lim.max_image_bytes, max_model_len=config.checkpoint.max_model_len,
                        max_videos_per_request=lim.max_videos_per_request, max_video_bytes=lim.max_video_bytes,
                        max_video_frames=lim.max_video_frames, max_video_duration_s=lim.max_video_duration_s,
                        max_video_frame_pixels=lim.max_video_frame_pixels,
                        video_decode_timeout_s=lim.video_decode_timeout_s)


def render_workers(config: EpdConfig) -> int:
    """--render-workers, or one per two cores (the other roles need the rest), at least 1."""
    return config.engines.render_workers or max(1, (os.cpu_count() or 2) // 2)


async def build(config: EpdConfig) -> RoleServer:
    from services.models.registry import resolve_model

    path = resolve_model(config.checkpoint.model)
    service = RenderService(path, config.checkpoint.served_model_id(), media_policy(config), limits(config),
                            num_workers=render_workers(config), cache_mb=config.engines.render_cache_mb,
                            dtype=config.checkpoint.dtype)
    if service.workers is not None:
        await asyncio.to_thread(service.workers.warm_up)  # each worker loads the image processor now
    mm_store = open_store(config, "mm")  # processed images, read by encode by handle
    servicer = RenderServicer(service, mm_store)

    def cleanup() -> None:
        service.close()
        mm_store.close()

    def register(server: grpc.aio.Server) -> None:
        from services.rpc.v1 import epd_pb2_grpc as rpc

        rpc.add_RenderServiceServicer_to_server(servicer, server)

    return RoleServer(name="render", register_grpc=register, cleanup=cleanup, http_routes=routes(service),
                      stores=[mm_store])
