"""uvicorn's h11 protocol with the limits a public endpoint needs: a request head of at most
h11_max_incomplete_event_size bytes and h11_max_header_count headers (431), a head that arrives within
timeout_header_read_s and a body within timeout_body_read_s after it (408; a slow client holds no connection), and
at most limit_concurrency open connections (503). Each refusal is OpenAI's error object and closes the connection."""

from __future__ import annotations

import asyncio
import http
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import GatewayConfig

_CODES = {400: None, 408: "request_timeout", 431: "request_header_fields_too_large", 503: "service_unavailable"}
_HEAD = [(b"content-type", b"application/json"), (b"connection", b"close")]


def error_body(status: int, message: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": _CODES.get(status)}}).encode()


def error_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response holding error_body, which closes the connection."""
    body = error_body(status, message)
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


async def send_error(send: Any, status: int, message: str) -> None:
    """The same through an ASGI send."""
    body = error_body(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": _HEAD + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def protocol_class(cfg: GatewayConfig) -> type[H11Protocol]:
    """LimitedH11Protocol with cfg's limits, for uvicorn.Config(http=...)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"cfg": cfg})


class LimitedH11Protocol(H11Protocol):
    cfg: GatewayConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = _HeaderCount(self.app, self.cfg.h11_max_header_count)
        self._timer: asyncio.TimerHandle | None = None
        self._reading_body = False  # which part the timer waits for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.cfg.limit_concurrency:
            self._refuse(503, f"the server holds {self.cfg.limit_concurrency} connections, its limit; retry later")
            return
        self._arm(self.cfg.timeout_header_read_s, body=False)

    def data_received(self, data: bytes) -> None:
        if self._timer is None and self.conn.their_state is h11.IDLE:  # a kept-alive connection's next request
            self._arm(self.cfg.timeout_header_read_s, body=False)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if not self._reading_body:
                self._arm(self.cfg.timeout_body_read_s, body=True)
        elif state is not h11.IDLE:  # the whole request is in, or the connection is over
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 refused the head: too large (431), else malformed (400)."""
        limit = self.cfg.h11_max_incomplete_event_size
        if len(self.conn.trailing_data[0]) > limit:
            self._refuse(431, f"the request head is over {limit} bytes")
        else:
            self._refuse(400, "the request is not valid HTTP/1.1")

    def _arm(self, seconds: float, body: bool) -> None:
        self._disarm()
        self._reading_body = body
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._reading_body = None, False

    def _expired(self) -> None:
        body, self._timer = self._reading_body, None
        if not body:
            self._refuse(408, f"the request head did not arrive within {self.cfg.timeout_header_read_s:g} s")
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not cycle.disconnected:
            self.loop.create_task(self._late_body(cycle))
        else:
            self.transport.close()

    async def _late_body(self, cycle: Any) -> None:
        """408 through the request's own cycle; the app reading the body then sees the client gone."""
        await send_error(cycle.send, 408, f"the request body did not arrive within {self.cfg.timeout_body_read_s:g} s")
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(error_response(status, message))
            self.transport.close()


class _HeaderCount:
    """ASGI: a request with more headers than the limit gets 431 before the app sees it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.limit:
            await send_error(send, 431, f"the request has {len(scope['headers'])} headers; the limit is {self.limit}")
            return
        await self.app(scope, receive, send)
