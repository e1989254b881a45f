"""dspark.v1.Generation over grpc.aio: reads each body within its method's size limit, names the caller, and maps
GatewayError codes to gRPC status (the one place that does)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError, Message

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from .auth import Access
from .config import GatewayConfig
from .gateway import GatewayCore, GatewayError

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "dspark.v1.Generation"


def _reader(cls: type[Message], limit: int) -> Callable[[bytes], Message | GatewayError]:
    """A deserializer that never raises (grpc would answer UNKNOWN): a body over the limit or not a valid message
    becomes a GatewayError, which the method raises after checking the caller."""
    name = cls.DESCRIPTOR.name

    def read(data: bytes) -> Message | GatewayError:
        if len(data) > limit:
            return GatewayError("INVALID_ARGUMENT", f"request is {len(data)} bytes; the limit is {limit}")
        try:
            return cls.FromString(data)
        except DecodeError:
            return GatewayError("INVALID_ARGUMENT", f"the request body is not a valid dspark.v1.{name}")

    return read


class GenerationServicer:
    def __init__(self, core: GatewayCore, access: Access) -> None:
        self.core, self.access = core, access

    def _admit(self, request: Message | GatewayError, context: grpc.aio.ServicerContext) -> str:
        caller = self.access.caller(context)  # before the body: an unauthenticated caller learns nothing
        if isinstance(request, GatewayError):
            raise request
        return caller

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            caller = self._admit(request, context)
            async for response in self.core.generate(request, context.time_remaining(), caller):
                yield response
        except Exception as e:
            await _fail(context, e)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            caller = self._admit(request, context)
            return pb.AbortResponse(aborted=await self.core.abort(list(request.request_ids), caller))
        except Exception as e:
            await _fail(context, e)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:
            self._admit(request, context)
            return self.core.model_info()
        except Exception as e:
            await _fail(context, e)

    async def GetServerStats(self, request: pb.GetServerStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.ServerStats:
        try:
            self._admit(request, context)
            return await self.core.server_stats()
        except Exception as e:
            await _fail(context, e)


def status(e: Exception) -> tuple[grpc.StatusCode, str]:
    """A GatewayError's code and message; anything else is a fault here: logged, and the client told only that."""
    if isinstance(e, GatewayError):
        return getattr(grpc.StatusCode, e.code), e.message
    log.error("dspark.v1 call failed", exc_info=e)
    return grpc.StatusCode.INTERNAL, "internal error; the request did not complete"


async def _fail(context: grpc.aio.ServicerContext, e: Exception) -> None:
    await context.abort(*status(e))


def rpc_handlers(servicer: GenerationServicer, cfg: GatewayConfig) -> dict[str, grpc.RpcMethodHandler]:
    """The service's methods with our readers, for server.add_registered_method_handlers."""
    small = cfg.max_control_request_bytes

    def unary(fn: Callable, cls: type[Message], out: type[Message]) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_reader(cls, small),
                                                   response_serializer=out.SerializeToString)

    return {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_reader(pb.GenerateRequest, cfg.max_request_bytes),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": unary(servicer.Abort, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": unary(servicer.GetModelInfo, pb.GetModelInfoRequest, pb.ModelInfo),
        "GetServerStats": unary(servicer.GetServerStats, pb.GetServerStatsRequest, pb.ServerStats),
    }
