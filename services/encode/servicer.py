"""Encode's gRPC servicer: decode the msgpack items, call EncodeService, answer handles.

An item with kwargs_ref_json comes by handle: kwargs_data is its skeleton and the
tensors are read from the mm store (services.connectors.mm).  Large inline items
are decoded in a worker thread, not on the event loop.
"""

from __future__ import annotations

import asyncio

import grpc

from services.connectors.mm import MmRef
from services.protocol.items import Item
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
        wanted = list(request.items)
        MM_BYTES.inc(sum(len(i.kwargs_data) + len(i.mm_metadata) for i in wanted))
        items = [await _decode(i.kwargs_data) for i in wanted]
        refs = [MmRef.from_json(i.kwargs_ref_json) if i.kwargs_ref_json else None for i in wanted]
        calls = [self.service.encode(i.mm_hash, item, ref) for i, item, ref in zip(wanted, items, refs, strict=True)]
        if not calls:
            return pb.EncodeResponse(request_id=request.request_id)
        # one item (the coordinator's call per image) is awaited here: a gather's task costs two loop turns
        results = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
        return pb.EncodeResponse(request_id=request.request_id, items=[
            pb.EncodedItem(mm_hash=r.mm_hash, handle_json=dumps(r.handle), cache_hit=r.cache_hit) for r in results])


OFF_LOOP_BYTES = 256 * 1024


async def _decode(raw: bytes) -> Item | None:
    if not raw:
        return None
    return decode_item(raw) if len(raw) <= OFF_LOOP_BYTES else await asyncio.to_thread(decode_item, raw)
