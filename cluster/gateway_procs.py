"""More gateway processes (`--api-server-count N`, vLLM's flag): N - 1 processes beside the first gateway, each with
its own gRPC server (and HTTP API) on the same ports, its own GatewayCore and its own request-stream connection to
the step loop. The ports are shared with SO_REUSEPORT, so the kernel spreads client connections over the
processes, and no one process's event loop takes in every request. Each process joins Ray as a driver to
reach the verifier; the first one (this module's caller) owns the pair and tells them when it is replaced and when
to drain."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .config import GatewayConfig

START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GatewayProcSpec:
    gcs_address: str  # the Ray cluster the pair runs in
    verifier: bytes  # the verifier's pickled actor handle (unpickled once the process has joined Ray)
    cfg: GatewayConfig  # the first gateway's, with the ports it bound and no probe port (that one is its own)
    index: int  # 1 .. N - 1


class GatewayProcs:
    """The first gateway's view of the others: start, re-point at a new pair, drain, stop."""

    def __init__(self, count: int, gcs_address: str, verifier: Any, cfg: GatewayConfig) -> None:
        self.count, self.gcs_address, self.cfg = count, gcs_address, cfg
        self.verifier = pickle.dumps(verifier)
        self.procs: list[mp.process.BaseProcess | None] = [None] * (count - 1)  # process i is procs[i - 1]
        self.pipes: list[Connection | None] = [None] * (count - 1)
        self.draining = False

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start them and wait until each serves; RuntimeError naming the first that did not."""
        for i in range(1, self.count):
            self._spawn(i)
        for i in range(1, self.count):
            self._ready(i, timeout_s)

    def _spawn(self, i: int) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no Ray, grpc or CUDA state inherited
        ours, theirs = ctx.Pipe()
        spec = GatewayProcSpec(self.gcs_address, self.verifier, self.cfg, i)
        p = ctx.Process(target=main, args=(spec, theirs), name=f"dspark-gateway-{i}", daemon=True)
        p.start()
        theirs.close()
        self.procs[i - 1], self.pipes[i - 1] = p, ours

    def _ready(self, i: int, timeout_s: float) -> None:
        pipe = self.pipes[i - 1]
        if not pipe.poll(timeout_s):
            raise RuntimeError(f"gateway process {i} did not start within {timeout_s:g} s")
        try:
            kind, detail = pipe.recv()
        except (EOFError, OSError):
            kind, detail = "error", "it exited"
        if kind != "ready":
            raise RuntimeError(f"gateway process {i} failed to start: {detail}")

    def revive(self, timeout_s: float = START_TIMEOUT_S) -> list[int]:
        """Start again each process that died (none once they were told to drain) -> their numbers. Its
        connections' streams failed with it; clients reconnect to the port and land on any process."""
        if self.draining:
            return []
        dead = [i for i, p in enumerate(self.procs, 1) if p is not None and p.exitcode is not None]
        for i in dead:
            self.pipes[i - 1].close()
            self._spawn(i)
        for i in dead:
            self._ready(i, timeout_s)
        return dead

    def _tell(self, *msg: Any) -> None:
        for pipe in filter(None, self.pipes):
            try:
                pipe.send(msg)
            except OSError:  # that process is gone; the others still hear
                pass

    def attach(self, verifier: Any) -> None:
        self.verifier = pickle.dumps(verifier)  # also for a process started again later
        self._tell("attach", self.verifier)

    def detach(self) -> None:
        self._tell("detach")

    def drain(self) -> None:
        self.draining = True
        self._tell("drain")

    async def wait(self, timeout_s: float) -> None:
        """Until every process has exited (they drain first), killing those still there after timeout_s."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while any(p.is_alive() for p in filter(None, self.procs)) and loop.time() < end:
            await asyncio.sleep(0.05)
        self.stop()

    def stop(self) -> None:
        for p in filter(None, self.procs):
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for pipe in filter(None, self.pipes):
            pipe.close()


def main(spec: GatewayProcSpec, pipe: Connection) -> None:
    """A gateway process: join Ray, serve until told to drain (or until the first gateway is gone)."""
    import ray

    from .metrics import log_requests_to_stderr

    log_requests_to_stderr()
    try:
        ray.init(address=spec.gcs_address, log_to_driver=False, logging_level="warning")
        asyncio.run(_serve(spec, pipe))
    except Exception as e:  # noqa: BLE001 - the first gateway reports it
        try:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        print(f"dspark-serve: gateway process {spec.index} failed: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        ray.shutdown()


async def _serve(spec: GatewayProcSpec, pipe: Connection) -> None:
    from .grpc_server import GatewayServer

    loop = asyncio.get_running_loop()
    server = GatewayServer(pickle.loads(spec.verifier), spec.cfg)
    await server.start()
    server.install_signal_handlers()  # a SIGTERM to the process group drains each process on its own
    tasks: set[asyncio.Task] = set()

    def run(coro) -> None:
        t = loop.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    def command() -> None:
        try:
            msg = pipe.recv()
        except (EOFError, OSError):  # the first gateway is gone: so is the pair's owner
            loop.remove_reader(pipe.fileno())
            run(server.drain_and_stop())
            return
        if msg[0] == "attach":
            run(server.core.attach(pickle.loads(msg[1])))
        elif msg[0] == "detach":
            run(server.core.detach())
        elif msg[0] == "drain":
            run(server.drain_and_stop())

    loop.add_reader(pipe.fileno(), command)
    pipe.send(("ready", server.port))
    await server.wait()
    loop.remove_reader(pipe.fileno())
