"""Gateway lifecycle: start the grpc.aio server (service, health, reflection; TLS when configured) and, with an HTTP
port, the OpenAI-compatible API with /metrics on the same loop and core; drain on SIGTERM, stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .auth import Access
from .config import GatewayConfig
from .gateway import GatewayCore
from .grpc_methods import SERVICE_NAME, GenerationServicer, rpc_handlers
from .health import Health
from .metrics import GaugeRefresher, PrometheusSink, ServingMetrics


class GatewayServer:
    def __init__(self, verifier: Any, cfg: GatewayConfig) -> None:
        self.verifier, self.cfg = verifier, cfg
        self.server: grpc.aio.Server | None = None
        self.probe_server: grpc.aio.Server | None = None  # plaintext grpc.health.v1 only, for kubelet probes
        self.core: GatewayCore | None = None
        self.health = Health()
        self.port = 0
        self.http = None  # http_server.HttpServer, with cfg.http_port
        self.http_port: int | None = None
        self.metrics_sink = PrometheusSink(cfg.metrics_dir) if cfg.http_port is not None else None  # /metrics lives on HTTP
        self._tasks: list[asyncio.Task] = []
        self.pair_gone: Callable[[], Awaitable[bool]] | None = None  # true: draining waits for nothing
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        info = await self.verifier.model_info.remote()
        self.core = GatewayCore(self.verifier, info, self.cfg)
        if self.metrics_sink is not None:
            self.core.metrics = ServingMetrics(self.metrics_sink, self.core.served_model_name)
        # Up to twice the largest limit a body reaches our readers, which answer INVALID_ARGUMENT naming the limit;
        # grpc refuses anything larger from its length prefix, before reading it.
        limit = 2 * max(self.cfg.max_request_bytes, self.cfg.max_control_request_bytes)
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                               ("grpc.max_send_message_length", max(limit, 64 << 20))])
        servicer = GenerationServicer(self.core, Access(self.cfg.api_keys))
        self.server.add_registered_method_handlers(SERVICE_NAME, rpc_handlers(servicer, self.cfg))
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        address = f"{self.cfg.host}:{self.cfg.port}"
        credentials = _tls(self.cfg)
        self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                     else self.server.add_insecure_port(address))
        if self.cfg.health_port is not None:
            self.probe_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.probe_server)
            self.probe_server.add_insecure_port(f"{self.cfg.host}:{self.cfg.health_port}")
        await self.core.start()
        await self.server.start()
        if self.probe_server is not None:
            await self.probe_server.start()
        if self.cfg.http_port is not None:
            await self._start_http()
        await self.health.set(True)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.health.watch_pair(lambda: self.core.verifier if self.core.conn else None,
                                                                   lambda: self.core.draining)))
        return self.port

    async def _start_http(self) -> None:
        from .http_server import HttpServer
        from .openai_api import HttpApi, build_app

        gauges = GaugeRefresher(self.core.metrics, self.core.server_stats)

        async def core() -> GatewayCore:
            return self.core

        async def serving() -> bool:
            return self.health.serving

        async def metrics_text() -> tuple[bytes, str]:
            await gauges.refresh()
            return self.metrics_sink.text()

        api = HttpApi(core, Access(self.cfg.api_keys), serving, self.cfg.max_request_bytes, metrics_text)
        self.http = HttpServer(build_app(api), self.cfg)
        self.http_port = await self.http.start()
        self._tasks.append(asyncio.get_running_loop().create_task(gauges.run()))

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: loop.create_task(self.drain_and_stop()))

    async def drain_and_stop(self) -> None:
        """NOT_SERVING first (load balancers move away), finish what runs, then stop."""
        if self.core.draining:
            return
        self.core.draining = True
        await self.health.set(False)
        await self.core.drain(self.cfg.drain_timeout_s, self.pair_gone)
        await self.stop()

    async def stop(self, grace_s: float = 2.0) -> None:
        for t in self._tasks:
            t.cancel()
        if self.http is not None:
            await self.http.stop()
        if self.core is not None:
            await self.core.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.probe_server is not None:
            await self.probe_server.stop(0)
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


def _tls(cfg: GatewayConfig) -> grpc.ServerCredentials | None:
    """Server credentials from PEM files; with ssl_ca_certs every client must present a certificate signed by it."""
    if cfg.ssl_certfile is None:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(cfg.ssl_ca_certs) if cfg.ssl_ca_certs else None
    return grpc.ssl_server_credentials([(read(cfg.ssl_keyfile), read(cfg.ssl_certfile))], root_certificates=ca,
                                       require_client_auth=ca is not None)
