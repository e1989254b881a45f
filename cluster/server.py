"""Gateway lifecycle: start the grpc.aio server (service, health, reflection), drain on SIGTERM, stop."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

from .config import GatewayConfig
from .handlers import GatewayCore
from .health import Health
from .servicer import SERVICE_NAME, GenerationServicer


class GatewayServer:
    def __init__(self, verifier: Any, cfg: GatewayConfig) -> None:
        self.verifier, self.cfg = verifier, cfg
        self.server: grpc.aio.Server | None = None
        self.core: GatewayCore | None = None
        self.health = Health()
        self.port = 0
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        info = await self.verifier.model_info.remote()
        self.core = GatewayCore(self.verifier, info, self.cfg)
        limit = max(64 << 20, 2 * self.cfg.max_request_bytes)  # our own size check answers INVALID_ARGUMENT
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                               ("grpc.max_send_message_length", limit)])
        dspark_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = self.server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        await self.core.start()
        await self.server.start()
        await self.health.set(True)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.health.watch_pair(self.verifier, lambda: self.core.draining)))
        return self.port

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
        await self.core.drain(self.cfg.drain_timeout_s)
        await self.stop()

    async def stop(self, grace_s: float = 2.0) -> None:
        for t in self._tasks:
            t.cancel()
        if self.core is not None:
            await self.core.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()
