"""dspark.v1.Generation over grpc.aio: reads each body within its method's size limit, names the caller, turns a
GenerateRequest into the gateway's request (here and for the Serve deployment), and maps GatewayError codes to gRPC
status (the one place that does)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError, Message

from dspark_serve.engine.structured_outputs import KINDS, StructuredOutputsParams
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import tool_calls
from .auth import Access
from .config import GatewayConfig
from .gateway import GatewayCore, GatewayError
from .gateway_request import Chat, ChatMessage, GatewayRequest, Sampling, Speculative

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "dspark.v1.Generation"
_OPTIONAL = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence and f.message_type is None]


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
            req = gateway_request(request, self.core.cfg.max_request_bytes)
            async for response in self.core.generate(req, context.time_remaining(), caller):
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


def gateway_request(msg: pb.GenerateRequest, max_bytes: int) -> GatewayRequest:
    """A dspark.v1.GenerateRequest as the gateway's request. INVALID_ARGUMENT for what has no typed form: a message
    over max_bytes, tools_json or tool_calls_json that is not a valid list of them, a structured output of no kind."""
    size = msg.ByteSize()
    if size > max_bytes:
        raise GatewayError("INVALID_ARGUMENT", f"request is {size} bytes; the limit is {max_bytes}")
    which, s, spec = msg.WhichOneof("input"), msg.sampling, msg.speculative
    try:
        prompt = _chat(msg.chat) if which == "chat" else tuple(msg.token_ids.ids) if which == "token_ids" else \
            msg.text if which == "text" else None
        sampling = Sampling(**{f: getattr(s, f) for f in _OPTIONAL if s.HasField(f)}, stop=tuple(s.stop),
                            stop_token_ids=tuple(s.stop_token_ids), logit_bias=tuple(sorted(s.logit_bias.items())),
                            structured_outputs=_structured(s.structured_outputs)
                            if s.HasField("structured_outputs") else None)
    except ValueError as e:
        raise GatewayError("INVALID_ARGUMENT", str(e)) from None
    speculative = Speculative(
        spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else None,
        spec.confidence_threshold if spec.HasField("confidence_threshold") else None, spec.disable)
    return GatewayRequest(prompt, msg.request_id, sampling, speculative)


def _structured(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError(f"sampling.structured_outputs sets no kind: set one of {', '.join(KINDS)}")
    value = getattr(msg, kind)
    return StructuredOutputsParams(**{kind: tuple(value.values) if kind == "choice" else value},
                                   disable_any_whitespace=msg.disable_any_whitespace)


def _chat(chat: pb.Chat) -> Chat:
    messages = tuple(ChatMessage(m.role, m.content, _calls(m.tool_calls_json, i), m.tool_call_id or None,
                                 m.name or None) for i, m in enumerate(chat.messages))
    tools = tool_calls.check_tools(_parsed(chat.tools_json, "chat.tools_json"), "chat.tools") \
        if chat.tools_json else None
    return Chat(messages, chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
                None if tools is None else tuple(tools), chat.tool_choice or None, chat.tool_choice_function or None,
                chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True)


def _calls(text: str, i: int) -> tuple[dict, ...]:
    if not text:
        return ()
    calls = _parsed(text, f"chat.messages[{i}].tool_calls_json")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ValueError(f"chat.messages[{i}].tool_calls_json must be a list of tool calls")
    return tuple(calls)


def _parsed(text: str, name: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None


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
