"""The OpenAI-compatible HTTP API over GatewayCore (Starlette): /v1/models, /v1/completions (one prompt or a batch) and
/v1/chat/completions (server-sent events when streamed), /health and /metrics. The gRPC methods' keys, validation and
errors; every failure, unknown routes and faults included, answers as OpenAI's error object."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import openai_answer as oa
from . import openai_convert as oc
from . import openai_tools
from .auth import Access
from .gateway import GatewayCore, GatewayError
from .gateway_request import GatewayRequest
from .json_body import BodyError, parse_object
from .prompt_streams import merged
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

    async def http_error(request: Request, e: HTTPException) -> Response:  # unknown route, method not allowed
        return _error(oc.APIError(e.status_code, f"{request.method} {request.url.path[:200]}: {e.detail}"))

    routes = [Route("/v1/models", models, methods=["GET"]), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    if api.metrics_text is not None:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    return Starlette(routes=routes, middleware=[Middleware(LastResort)], exception_handlers={HTTPException: http_error})


class LastResort:
    """A fault anywhere in the app: logged here, and the client told only that, as OpenAI's error object (or, once
    a response has started, the connection is closed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # noqa: BLE001 - the last place a fault can be answered
            if scope["type"] != "http":
                raise
            err = _api_error(e)
            if not started:
                await _error(err)(scope, receive, send)


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
    """Errors before the first message of every prompt answer with their status; later ones end the event stream."""
    try:
        caller = _caller(api, request)  # before the body: an unauthenticated caller learns nothing
        body = await _json_body(request, api.max_body_bytes)
        core = await api.core()
        oc.check_model(body, core.served_model_name)
        vocab = core.info["vocab_size"]
        if chat:
            req, opts = oc.chat_request(body, vocab)
            reqs = [req]
        else:
            reqs, opts = oc.completion_request(body, vocab, core.cfg.max_queue)
        stream = merged([core.generate(r, None, caller) for r in reqs])
        first = await anext(stream)
    except Exception as e:  # noqa: BLE001 - every failure answers as OpenAI's error object
        return _error(e)
    prompts = [oa.Prompt(_prompt_text(core, r) if opts.echo else "") for r in reqs]
    rid = reqs[0].request_id.rsplit("-", 1)[0] if len(reqs) > 1 else first[1].request_id
    answer = _Answer(rid, core.served_model_name, opts, _piece(core), prompts)
    if opts.stream:
        return StreamingResponse(answer.events(first, stream), media_type="text/event-stream")
    try:
        seqs = await _while_connected(request, answer.collect(first, stream))
    except Exception as e:  # noqa: BLE001
        return _error(e)
    return JSONResponse(answer.json(seqs)) if seqs is not None else Response(status_code=499)


class _Answer:
    """One request's messages (each tagged with its prompt) as OpenAI's answer: whole, or as server-sent events."""

    def __init__(self, rid: str, model: str, opts: oc.Options, piece: oa.Piece, prompts: list[oa.Prompt]) -> None:
        self.rid, self.model, self.opts, self.piece, self.prompts = rid, model, opts, piece, prompts
        self.created = int(time.time())
        self.seqs: dict[int, oa.Sequence] = {}
        self.tools: dict[int, ToolStream] = {}  # opts.tools: each choice's tool-call parser

    def _take(self, tagged: tuple[int, pb.GenerateResponse]) -> tuple[int, oa.Sequence]:
        p, msg = tagged
        index = p * self.opts.n + msg.index
        seq = self.seqs.setdefault(index, oa.Sequence(self.prompts[p]))
        if msg.HasField("chunk"):
            if msg.chunk.prompt_logprobs:
                seq.prompt.logprobs = list(msg.chunk.prompt_logprobs)
            seq.text.append(msg.chunk.text)
            seq.logprobs.extend(msg.chunk.logprobs)
        else:
            seq.final = msg.complete
        return index, seq

    async def collect(self, first: tuple, stream: AsyncIterator) -> dict[int, oa.Sequence]:
        async with aclosing(stream):
            self._take(first)
            async for tagged in stream:
                self._take(tagged)
        return self.seqs

    def json(self, seqs: dict[int, oa.Sequence]) -> dict:
        return oa.response_json(self.rid, self.model, self.created, seqs, self.opts, self.piece)

    async def events(self, first: tuple, stream: AsyncIterator) -> AsyncIterator[str]:
        async with aclosing(stream):
            try:
                tagged = first
                while tagged is not None:
                    for chunk in self._chunks(tagged):
                        yield _event(chunk)
                    tagged = await anext(stream, None)
                if self.opts.include_usage:
                    finals = [self.seqs[i].final for i in sorted(self.seqs)]
                    yield _event(oa.usage_chunk_json(self.rid, self.model, self.created, self.opts, finals))
            except Exception as e:  # noqa: BLE001 - the status line is sent: the error travels as an event
                yield _event(_api_error(e).body())
        yield "data: [DONE]\n\n"

    def _chunks(self, tagged: tuple[int, pb.GenerateResponse]) -> list[dict]:
        p, msg = tagged
        index = p * self.opts.n + msg.index
        new = index not in self.seqs
        before = self.seqs[index] if not new else None
        offset = sum(map(len, before.text)) if before is not None else 0
        index, seq = self._take(tagged)
        args = (self.rid, self.model, self.created, self.opts, index)
        out = [oa.chunk_json(*args, role=True)] if new and self.opts.chat else []
        tools = self.tools.setdefault(index, ToolStream()) if self.opts.tools else None
        if new and (self.opts.echo or self.opts.prompt_logprobs is not None):
            out.append(self._prompt_chunk(args, seq.prompt))
            offset += len(seq.prompt.text)
        if msg.HasField("chunk"):
            lp = None
            if self.opts.top_logprobs is not None and msg.chunk.logprobs:
                entries = list(msg.chunk.logprobs)
                lp = oa.chat_logprobs(entries, self.piece) if self.opts.chat else \
                    oa.completion_logprobs(entries, self.piece, offset)
            text, calls = msg.chunk.text, []
            if tools is not None:  # tool calls leave the content and stream as tool-call deltas
                before = len(tools.calls)
                text, calls = tools.feed(text)
                calls = openai_tools.call_deltas(calls, before)
            if text or lp or calls:  # tokens that end inside a UTF-8 character have no text yet
                out.append(oa.chunk_json(*args, text=text if text or not calls else None, logprobs=lp,
                                         tool_calls=calls))
        else:
            if tools is not None:
                before = len(tools.calls)
                text, calls = tools.finish()
                if text or calls:
                    out.append(oa.chunk_json(*args, text=text or None,
                                             tool_calls=openai_tools.call_deltas(calls, before)))
            out.append(oa.chunk_json(*args, final=seq.final, called=tools is not None and bool(tools.calls)))
        return out

    def _prompt_chunk(self, args: tuple, prompt: oa.Prompt) -> dict:
        """A choice's echo (its prompt's text, and logprobs when asked) and vLLM's prompt_logprobs, first."""
        lp = None
        if self.opts.echo and self.opts.top_logprobs is not None and prompt.logprobs:
            lp = oa.completion_logprobs(prompt.logprobs, self.piece)
        plp = oa.prompt_logprobs_json(prompt.logprobs, self.piece) if self.opts.prompt_logprobs is not None else None
        return oa.chunk_json(*args, text=prompt.text if self.opts.echo else None, logprobs=lp, prompt_logprobs=plp)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _json_body(request: Request, limit: int) -> dict:
    """The body within `limit` bytes (413 as soon as it passes), parsed and checked (json_body.py)."""
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise oc.APIError(413, f"the request body is over {limit} bytes")
        parts.append(part)
    return parse_object(b"".join(parts))


def _prompt_text(core: GatewayCore, req: GatewayRequest) -> str:
    """A prompt as echo shows it: the text sent, or the token ids' text."""
    if isinstance(req.prompt, str):
        return req.prompt
    piece = _piece(core)
    return "".join(piece(t)[0] for t in req.prompt) if core.token_text is None else \
        b"".join(bytes(piece(t)[1]) for t in req.prompt).decode("utf-8", "replace")


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


def _piece(core: GatewayCore) -> oa.Piece:
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
    if isinstance(e, BodyError):
        return oc.APIError(e.status, e.message, e.param)
    if isinstance(e, GatewayError):
        return oc.from_status(e.code, e.message)
    if isinstance(e, ClientDisconnect):  # gone while sending its body: nobody reads the answer
        return oc.APIError(499, "the client closed the connection")
    log.error("HTTP call failed", exc_info=e)
    return oc.APIError(500, "internal error; the request did not complete")


class _ErrorJSON(JSONResponse):
    """ASCII JSON: an error message quoting the client's text renders whatever that text is."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(e: Exception) -> JSONResponse:
    err = _api_error(e)
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return _ErrorJSON(err.body(), status_code=err.status, headers=headers)
