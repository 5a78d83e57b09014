"""Encode's gRPC servicer: decode the msgpack items, call EncodeService, answer handles."""

from __future__ import annotations

import asyncio

import grpc

from services.protocol.serialization import decode_item
from services.rpc.convert import dumps
from services.rpc.handlers import rpc_method
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from .serving import MM_BYTES, EncodeService


class EncodeServicer(rpc.EncodeServiceServicer):
    def __init__(self, service: EncodeService) -> None:
        self.service = service

    @rpc_method
    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext):
        MM_BYTES.inc(sum(len(i.kwargs_data) + len(i.mm_metadata) for i in request.items))
        items = [decode_item(i.kwargs_data) if i.kwargs_data else None for i in request.items]
        results = await asyncio.gather(*(self.service.encode(i.mm_hash, item)
                                         for i, item in zip(request.items, items, strict=True)))
        return pb.EncodeResponse(request_id=request.request_id, items=[
            pb.EncodedItem(mm_hash=r.mm_hash, handle_json=dumps(r.handle), cache_hit=r.cache_hit) for r in results])
