"""grpc.health.v1 for the gateway: overall ("") and per service; NOT_SERVING while draining, or when the pair is gone,
does not answer or its step loop failed (a long step is not a failure)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health, health_pb2

from .grpc_methods import SERVICE_NAME

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.serving = False

    async def set(self, serving: bool) -> None:
        self.serving = serving
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)

    async def watch_pair(self, verifier: Callable[[], Any], is_draining, period_s: float = 1.0) -> None:
        """Probe the real request path: the current verifier (`verifier()`, None while a new pair starts) reports
        a dead or failed step loop; one that does not answer within 10 s counts as gone."""
        while True:
            try:
                ok = (await asyncio.wait_for(verifier().health.remote(), timeout=10))["ok"]
            except Exception:  # noqa: BLE001 - an unreachable pair is unhealthy
                ok = False
            await self.set(ok and not is_draining())
            await asyncio.sleep(period_s)
