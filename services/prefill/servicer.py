"""Prefill's gRPC servicer: parse the proto, call PrefillService, answer kv_transfer_params."""

from __future__ import annotations

import grpc

from services.connectors.mm import MmRef
from services.protocol.errors import InvalidRequest
from services.protocol.serialization import decode_item
from services.rpc.convert import dumps, loads, sampling_from_pb
from services.rpc.handlers import rpc_method
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from .serving import MM_BYTES, PrefillItem, PrefillService


def items_from_pb(items: list[pb.MultiModalItem]) -> list[PrefillItem]:
    out = []
    for item in items:
        if not item.mm_metadata:
            raise InvalidRequest(f"item {item.mm_hash}: mm_metadata is required", code="missing_mm_metadata")
        # kwargs_data reaches prefill only when no encoder could take the item (inline_encode.py).
        kwargs = decode_item(item.kwargs_data) if item.kwargs_data else None
        ref = MmRef.from_json(item.kwargs_ref_json) if item.kwargs_ref_json else None  # pixels by handle
        out.append(PrefillItem(item.modality, item.mm_hash, item.offset, item.length, decode_item(item.mm_metadata),
                               kwargs, ref))
    return out


class PrefillServicer(rpc.PrefillServiceServicer):
    def __init__(self, service: PrefillService) -> None:
        self.service = service

    @rpc_method
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        MM_BYTES.inc(sum(len(i.kwargs_data) + len(i.mm_metadata) for i in request.items))
        ec_params = _checked_handles(request, loads(request.ec_transfer_params_json) or {})
        salt = request.cache_salt if request.HasField("cache_salt") else None
        outcome = await self.service.prefill(request.request_id, list(request.token_ids),
                                             items_from_pb(list(request.items)), ec_params,
                                             sampling_from_pb(request.sampling), salt)
        return pb.PrefillResponse(request_id=request.request_id, first_token_id=outcome.first_token_id,
                                  kv_transfer_params_json=dumps(outcome.kv_transfer_params),
                                  prompt_tokens=outcome.prompt_tokens, cached_tokens=outcome.cached_tokens)


def _checked_handles(request: pb.PrefillRequest, ec_params: dict) -> dict:
    if request.items and not ec_params and not all(i.kwargs_data for i in request.items):
        raise InvalidRequest("metadata-only multimodal items require ec_transfer_params",
                             code="missing_ec_transfer_params")
    return ec_params
