"""The standalone service (`dspark-serve serve`; serve_app.py is the Ray Serve one): Ray (embedded or joined), the
draft+verifier pair, the gateway; drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import replace
from collections.abc import Callable
from typing import Any

from .config import GatewayConfig, PairConfig
from .metrics import log_requests_to_stderr

log = logging.getLogger(__name__)
REVIVE_S = 1.0  # how often the gateway processes are looked at


def start_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join `address`, or start an embedded single-node Ray whose servers all bind loopback (call it before ray is
    imported). Token auth stays as Ray sets it (RAY_AUTH_MODE)."""
    if not address:
        # Ray swaps a loopback node address for the host's IP, and its servers then listen on every interface,
        # unless it runs as a local-only instance; set before the import, so Ray's own processes inherit it too.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # address="local": a new instance even where another Ray runs on this machine (ray.init would join that one)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})


async def serve(pair_cfg: PairConfig, gw_cfg: GatewayConfig, on_ready: Callable[[Any], None] | None = None) -> None:
    """`on_ready(server)`: the started grpc_server.GatewayServer (its port, its http_port), once every gateway
    process serves."""
    from .gateway_procs import GatewayProcs
    from .grpc_server import GatewayServer
    from .pair import create_pair
    from .supervisor import PairSupervisor

    loop = asyncio.get_running_loop()
    pair = await loop.run_in_executor(None, create_pair, pair_cfg)
    server = GatewayServer(pair.verifier, gw_cfg)
    supervisor, procs = None, None
    try:
        await server.start()
        if gw_cfg.api_server_count > 1:
            import ray

            others = replace(gw_cfg, port=server.port, http_port=server.http_port, health_port=None)
            procs = GatewayProcs(gw_cfg.api_server_count, ray._private.worker.global_worker.node.gcs_address,
                                 pair.verifier, others)
            await loop.run_in_executor(None, procs.start)

        async def lost() -> None:
            if procs is not None:
                procs.detach()
            await server.core.detach()

        async def new_pair(p) -> None:
            await server.core.attach(p.verifier)
            if procs is not None:
                procs.attach(p.verifier)

        async def drain() -> None:
            if procs is not None:
                procs.drain()
            await server.drain_and_stop()

        async def revive() -> None:  # a gateway process that died is started again while the service serves
            while procs is not None and not server.core.draining:
                try:
                    for i in await loop.run_in_executor(None, procs.revive):
                        log.warning("gateway process %d died and was started again", i)
                except RuntimeError as e:
                    log.error("%s; retrying", e)
                await asyncio.sleep(REVIVE_S)

        supervisor = PairSupervisor(pair_cfg, pair, lost, new_pair, lambda: server.core.draining)
        watch = loop.create_task(supervisor.run())
        reviver = loop.create_task(revive())
        server.pair_gone = _ray_gone
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: loop.create_task(drain()))
        if on_ready is not None:
            on_ready(server)
        await server.wait()
        watch.cancel()
        reviver.cancel()
        if procs is not None:
            await procs.wait(gw_cfg.drain_timeout_s + 5)
    finally:
        if procs is not None:
            procs.stop()
        if supervisor is not None:
            supervisor.stop()
            pair = supervisor.pair
        if not await _shutdown_pair(pair):
            _exit_without_ray()


def _exit_without_ray() -> None:
    """Ray stopped under the server (a SIGTERM to the whole process group or cgroup reaches Ray's processes too):
    nothing is left to stop, and waiting would take minutes (Ray calls in flight, and the exit handler Ray registered,
    wait on its GCS). Ray's processes end with this one (they share its fate)."""
    print("dspark-serve: stopped (Ray stopped with it)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


async def _shutdown_pair(pair: Any) -> bool:
    """pair.shutdown, unless Ray goes away meanwhile (its actors then end with it, and Ray calls would wait for
    minutes): -> whether Ray was there to the end."""
    done = threading.Event()

    def shutdown() -> None:
        pair.shutdown()
        done.set()

    threading.Thread(target=shutdown, name="dspark-pair-shutdown", daemon=True).start()
    while not done.is_set():
        if not await asyncio.to_thread(ray_reachable):
            return False
        await asyncio.sleep(0.05)
    return True


async def _ray_gone() -> bool:
    return not await asyncio.to_thread(ray_reachable)


def ray_reachable(timeout_s: float = 0.5) -> bool:
    """Whether Ray's GCS accepts connections (it stops listening as soon as it is told to stop)."""
    import ray

    host, port = ray._private.worker.global_worker.node.gcs_address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def run(pair_cfg: PairConfig, gw_cfg: GatewayConfig, address: str | None, num_cpus: int | None) -> int:
    with tempfile.TemporaryDirectory(prefix="dspark-metrics-") as metrics_dir:
        if gw_cfg.api_server_count > 1 and gw_cfg.http_port is not None:
            # prometheus_client reads it when first imported, here and in the gateway processes (which inherit it)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
            gw_cfg = replace(gw_cfg, metrics_dir=metrics_dir)
        return _run(pair_cfg, gw_cfg, address, num_cpus)


def _run(pair_cfg: PairConfig, gw_cfg: GatewayConfig, address: str | None, num_cpus: int | None) -> int:
    start_ray(address, num_cpus)
    log_requests_to_stderr()
    import ray

    if not address and pair_cfg.channel_host is None:
        pair_cfg = replace(pair_cfg, channel_host="127.0.0.1")

    def ready(server) -> None:
        if server.http_port is not None:  # first: the gRPC line below is the one scripts wait for
            print(f"dspark-serve: serving the OpenAI-compatible HTTP API on {gw_cfg.host}:{server.http_port}",
                  flush=True)
        print(f"dspark-serve: serving dspark.v1.Generation on {gw_cfg.host}:{server.port}"
              + (f" ({gw_cfg.api_server_count} gateway processes)" if gw_cfg.api_server_count > 1 else ""), flush=True)

    try:
        asyncio.run(serve(pair_cfg, gw_cfg, ready))
    finally:
        ray.shutdown()
    print("dspark-serve: stopped", file=sys.stderr, flush=True)
    return 0
