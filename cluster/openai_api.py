"""The OpenAI-compatible HTTP API over GatewayCore (Starlette): /v1/models, /v1/completions and /v1/chat/completions
(server-sent events when streamed), /health and /metrics. The gRPC methods' keys, validation and errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import openai_convert as oc
from . import openai_tools
from .auth import Access
from .gateway import GatewayCore, GatewayError
from .tool_calls import ToolStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpApi:
    core: Callable[[], Awaitable[GatewayCore]]  # the started core (Serve starts it on the first call)
    access: Access
    serving: Callable[[], Awaitable[bool]]  # /health: 200 when true
    max_body_bytes: int
    metrics_text: Callable[[], Awaitable[tuple[bytes, str]]] | None = None  # /metrics: (body, content type)


def build_app(api: HttpApi) -> Starlette:
    created = int(time.time())

    async def models(request: Request) -> Response:
        try:
            _caller(api, request)
            core = await api.core()
            info = core.model_info()
        except Exception as e:  # noqa: BLE001 - every failure answers as OpenAI's error object
            return _error(e)
        return JSONResponse({"object": "list", "data": [{
            "id": info.served_model_name, "object": "model", "created": created, "owned_by": "dspark-serve",
            "root": info.target, "max_model_len": info.max_model_len}]})

    async def completions(request: Request) -> Response:
        return await _generate(api, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(api, request, chat=True)

    async def health(request: Request) -> Response:
        if await api.serving():
            return Response(status_code=200)
        return _error(oc.APIError(503, "not serving: draining, or the model pair is unavailable"))

    async def metrics(request: Request) -> Response:
        body, content_type = await api.metrics_text()
        return Response(body, media_type=content_type)

    routes = [Route("/v1/models", models, methods=["GET"]), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    if api.metrics_text is not None:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    return Starlette(routes=routes)


class _HttpCall:
    """What auth.Access reads of a call, from an HTTP request: the Authorization header and the peer."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def invocation_metadata(self) -> list[tuple[str, str]]:
        value = self.request.headers.get("authorization")
        return [] if value is None else [("authorization", value)]

    def peer_identities(self) -> None:
        return None

    def peer(self) -> str:
        client = self.request.client
        return f"ipv4:{client.host}:{client.port}" if client else "unknown"


def _caller(api: HttpApi, request: Request) -> str:
    return api.access.caller(_HttpCall(request))


async def _generate(api: HttpApi, request: Request, chat: bool) -> Response:
    """Errors before the first message answer with their status; later ones end the event stream."""
    try:
        caller = _caller(api, request)  # before the body: an unauthenticated caller learns nothing
        body = await _json_body(request, api.max_body_bytes)
        core = await api.core()
        oc.check_model(body, core.served_model_name)
        req, opts = oc.chat_request(body) if chat else oc.completion_request(body)
        stream = core.generate(req, None, caller)
        first = await anext(stream)
    except Exception as e:  # noqa: BLE001 - every failure answers as OpenAI's error object
        return _error(e)
    answer = _Answer(first.request_id, core.served_model_name, opts, _piece(core))
    if opts.stream:
        return StreamingResponse(answer.events(first, stream), media_type="text/event-stream")
    try:
        seqs = await _while_connected(request, answer.collect(first, stream))
    except Exception as e:  # noqa: BLE001
        return _error(e)
    return JSONResponse(answer.json(seqs)) if seqs is not None else Response(status_code=499)


class _Answer:
    """One request's messages as OpenAI's answer: whole, or as server-sent events."""

    def __init__(self, rid: str, model: str, opts: oc.Options, piece: oc.Piece) -> None:
        self.rid, self.model, self.opts, self.piece = rid, model, opts, piece
        self.created = int(time.time())
        self.seqs: dict[int, oc.Sequence] = {}
        self.tools: dict[int, ToolStream] = {}  # opts.tools: each sequence's tool-call parser

    def _take(self, msg: pb.GenerateResponse) -> oc.Sequence:
        seq = self.seqs.setdefault(msg.index, oc.Sequence())
        if msg.HasField("chunk"):
            seq.text.append(msg.chunk.text)
            seq.logprobs.extend(msg.chunk.logprobs)
        else:
            seq.final = msg.complete
        return seq

    async def collect(self, first: pb.GenerateResponse, stream: AsyncIterator) -> dict[int, oc.Sequence]:
        async with aclosing(stream):
            self._take(first)
            async for msg in stream:
                self._take(msg)
        return self.seqs

    def json(self, seqs: dict[int, oc.Sequence]) -> dict:
        return oc.response_json(self.rid, self.model, self.created, seqs, self.opts, self.piece)

    async def events(self, first: pb.GenerateResponse, stream: AsyncIterator) -> AsyncIterator[str]:
        async with aclosing(stream):
            try:
                msg = first
                while msg is not None:
                    for chunk in self._chunks(msg):
                        yield _event(chunk)
                    msg = await anext(stream, None)
                if self.opts.include_usage:
                    finals = [self.seqs[i].final for i in sorted(self.seqs)]
                    yield _event(oc.usage_chunk_json(self.rid, self.model, self.created, self.opts, finals))
            except Exception as e:  # noqa: BLE001 - the status line is sent: the error travels as an event
                yield _event(_api_error(e).body())
        yield "data: [DONE]\n\n"

    def _chunks(self, msg: pb.GenerateResponse) -> list[dict]:
        new = msg.index not in self.seqs
        offset = sum(map(len, self.seqs[msg.index].text)) if not new else 0
        seq = self._take(msg)
        args = (self.rid, self.model, self.created, self.opts, msg.index)
        out = [oc.chunk_json(*args, role=True)] if new and self.opts.chat else []
        tools = self.tools.setdefault(msg.index, ToolStream()) if self.opts.tools else None
        if msg.HasField("chunk"):
            lp = None
            if self.opts.top_logprobs is not None and msg.chunk.logprobs:
                lp = oc.logprobs_json(list(msg.chunk.logprobs), self.piece, self.opts.chat, offset)
            text, calls = msg.chunk.text, []
            if tools is not None:  # tool calls leave the content and stream as tool-call deltas
                before = len(tools.calls)
                text, calls = tools.feed(text)
                calls = openai_tools.call_deltas(calls, before)
            if text or lp or calls:  # tokens that end inside a UTF-8 character have no text yet
                out.append(oc.chunk_json(*args, text=text if text or not calls else None, logprobs=lp,
                                         tool_calls=calls))
        else:
            if tools is not None:
                before = len(tools.calls)
                text, calls = tools.finish()
                if text or calls:
                    out.append(oc.chunk_json(*args, text=text or None,
                                             tool_calls=openai_tools.call_deltas(calls, before)))
            out.append(oc.chunk_json(*args, final=seq.final, called=tools is not None and bool(tools.calls)))
        return out


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _json_body(request: Request, limit: int) -> dict:
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise oc.APIError(413, f"the request body is over {limit} bytes")
        parts.append(part)
    try:
        body = json.loads(b"".join(parts))
    except ValueError as e:
        raise oc.APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise oc.APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _while_connected(request: Request, work: Awaitable) -> object | None:
    """`work`'s result, or None when the client went away first (then `work` is cancelled, which aborts the
    request and frees its blocks)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        gone.cancel()
        task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _piece(core: GatewayCore) -> oc.Piece:
    """A token's text and bytes, for logprobs."""
    text = core.token_text

    def piece(token_id: int) -> tuple[str, list[int]]:
        if text is None:
            return str(token_id), []
        table = text.table
        raw = table[token_id] if table is not None and token_id < len(table) else b""
        if not raw:
            raw = (text.tokenizer.id_to_token(token_id) or "").encode()
        return raw.decode("utf-8", "replace"), list(raw)

    return piece


def _api_error(e: Exception) -> oc.APIError:
    if isinstance(e, oc.APIError):
        return e
    if isinstance(e, GatewayError):
        return oc.from_status(e.code, e.message)
    log.error("HTTP call failed", exc_info=e)
    return oc.APIError(500, "internal error; the request did not complete")


def _error(e: Exception) -> JSONResponse:
    err = _api_error(e)
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
