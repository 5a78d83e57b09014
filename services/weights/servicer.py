"""The WeightsService of encode, prefill and decode: what the coordinator's weight updates call (role.py)."""

from __future__ import annotations

import grpc

from services.rpc.handlers import rpc_method
from services.rpc.v1 import epd_pb2 as pb
from services.rpc.v1 import epd_pb2_grpc as rpc

from .role import RoleWeights


def to_info(weights: RoleWeights) -> pb.WeightsInfo:
    return pb.WeightsInfo(**weights.info())


class WeightsServicer(rpc.WeightsServiceServicer):
    def __init__(self, weights: RoleWeights) -> None:
        self.weights = weights

    @rpc_method
    async def Stage(self, request: pb.StageRequest, context: grpc.aio.ServicerContext) -> pb.WeightsInfo:
        await self.weights.stage(request.weight_version, request.path)
        return to_info(self.weights)

    @rpc_method
    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.WeightsInfo:
        await self.weights.commit(request.weight_version)
        return to_info(self.weights)

    @rpc_method
    async def Discard(self, request: pb.DiscardRequest, context: grpc.aio.ServicerContext) -> pb.WeightsInfo:
        await self.weights.discard(request.weight_version)
        return to_info(self.weights)

    @rpc_method
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.WeightsInfo:
        return to_info(self.weights)


def register(server: grpc.aio.Server, weights: RoleWeights) -> None:
    rpc.add_WeightsServiceServicer_to_server(WeightsServicer(weights), server)
