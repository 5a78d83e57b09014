"""Decode's gRPC servicer: a server stream of DecodeChunks; cancellation aborts the request."""

from __future__ import annotations

import grpc

from services.protocol.errors import InternalError, InvalidRequest
from services.protocol.logprobs import dumps_list
from services.rpc.convert import dumps, loads, sampling_from_pb
from services.rpc.handlers import rpc_method, rpc_stream
from services.rpc.inputs_follow import check_can_follow, inputs_that_follow
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from .serving import RESERVED, DecodeService
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
        if request.inputs_follow_ms:   # opened ahead: prefill's answer comes as the inputs
            check_can_follow(context, "Decode")

            async def kv_params() -> dict:
                answer = await inputs_that_follow(context, request.inputs_follow_ms, pb.PrefillResponse, "Decode")
                if answer.prompt_tokens != request.prompt_tokens:
                    raise InvalidRequest(f"the prefill answer has {answer.prompt_tokens} prompt tokens, the call "
                                         f"said {request.prompt_tokens}", code="invalid_kv_transfer_params")
                return loads(answer.kv_transfer_params_json)
        else:
            kv_params = loads(request.kv_transfer_params_json)
        events = self.service.decode(request.request_id, kv_params, sampling_from_pb(request.sampling),
                                     list(request.prompt_token_ids), prompt_len=request.prompt_tokens or None,
                                     announce_reserved=request.ack_reserved)
        async for event in events:
            if event is RESERVED:
                yield pb.DecodeChunk(reserved=True)
                continue
            if event.finish_reason == "error":
                raise InternalError(event.error or "decode failed", code="decode_error")
            yield to_chunk(event, request.prompt_tokens)

    @rpc_method
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
        return pb.AbortResponse(aborted=self.service.abort(list(request.request_ids)))
