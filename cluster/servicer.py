"""dspark.v1.Generation over grpc.aio: maps GatewayError codes to gRPC status, nothing else."""

from __future__ import annotations

import grpc

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb
from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

from .handlers import GatewayCore, GatewayError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "dspark.v1.Generation"


class GenerationServicer(dspark_pb2_grpc.GenerationServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async for response in self.core.generate(request, context.time_remaining()):
                yield response
        except GatewayError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=await self.core.abort(list(request.request_ids)))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return self.core.model_info()

    async def GetServerStats(self, request: pb.GetServerStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.ServerStats:
        return await self.core.server_stats()
