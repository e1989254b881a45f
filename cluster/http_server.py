"""The HTTP listener: uvicorn on the gateway's event loop, with the gateway's TLS files and connection limits
(http_limits.py). The gateway keeps the signal handlers (SIGTERM drains), so uvicorn takes none."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn

from .config import GatewayConfig
from .http_limits import protocol_class


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(self, app: Any, cfg: GatewayConfig) -> None:
        self.app, self.cfg = app, cfg
        self.server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Listens on cfg.host:cfg.http_port; -> the port (a free one for 0)."""
        c = self.cfg
        sock = socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if c.api_server_count > 1:  # every gateway process listens here; the kernel spreads the connections
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((c.host, c.http_port))
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                http=protocol_class(c), h11_max_incomplete_event_size=c.h11_max_incomplete_event_size,
                                timeout_keep_alive=c.timeout_keep_alive_s, timeout_graceful_shutdown=5,
                                ssl_certfile=c.ssl_certfile, ssl_keyfile=c.ssl_keyfile,
                                ssl_ca_certs=c.ssl_ca_certs,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if c.ssl_ca_certs else ssl.CERT_NONE)
        self.server = _Uvicorn(config)
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # its startup error
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        """Refuse new connections, let open responses end (at most timeout_graceful_shutdown), close."""
        if self.server is None or self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 10)
        except Exception:  # noqa: BLE001 - stopping: nothing left to report to
            self._task.cancel()
