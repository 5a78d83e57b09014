"""Decode's gRPC servicer: a server stream of DecodeChunks; cancellation aborts the request."""

from __future__ import annotations

import grpc

from services.protocol.errors import InternalError
from services.protocol.logprobs import dumps_list
from services.rpc.convert import dumps, loads, sampling_from_pb
from services.rpc.handlers import rpc_method, rpc_stream
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from .serving import DecodeService
from .stream import DecodeEvent


def to_chunk(event: DecodeEvent, prompt_tokens: int) -> pb.DecodeChunk:
    chunk = pb.DecodeChunk(token_ids=event.token_ids, text=event.text, finish_reason=event.finish_reason or "",
                           stop_reason="" if event.stop_reason is None else str(event.stop_reason))
    if event.logprobs:
        chunk.logprobs_json = dumps(dumps_list(event.logprobs))
    if event.finished:
        chunk.usage.prompt_tokens = prompt_tokens
        chunk.usage.completion_tokens = event.completion_tokens
    return chunk


class DecodeServicer(rpc.DecodeServiceServicer):
    def __init__(self, service: DecodeService) -> None:
        self.service = service

    @rpc_stream
    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        events = self.service.decode(request.request_id, loads(request.kv_transfer_params_json),
                                     sampling_from_pb(request.sampling), list(request.prompt_token_ids),
                                     resumed=list(request.resumed_token_ids))
        async for event in events:
            if event.finish_reason == "error":
                raise InternalError(event.error or "decode failed", code="decode_error")
            yield to_chunk(event, request.prompt_tokens)

    @rpc_method
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
        return pb.AbortResponse(aborted=self.service.abort(list(request.request_ids)))
