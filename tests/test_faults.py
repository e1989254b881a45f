"""Faults through the real service: real Ray actors killed with SIGKILL, the real gateway and gRPC on 127.0.0.1.
A lost draft actor costs nothing but speed until its replacement attaches; a lost verifier ends its streams with a
clean UNAVAILABLE and a new pair serves; a step loop that fails ends every open stream at once."""

import asyncio
import os
import signal
import subprocess
import threading
import time

import grpc
import pytest
from service import ServerProcess

from dspark_serve.actors.frames import Add, Fatal
from dspark_serve.actors.request_stream import SyncStreamClient
from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair

PROMPTS = [[5, 6, 7], [100, 3, 42, 9], [11] * 6, [250, 1]]
TOKENS = 160


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)


@pytest.fixture(scope="module")
def reference(pair_dirs):
    llm = LLM(str(pair_dirs[0]), None, device="cpu", block_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS,
                                                                       ignore_eos=True))]


def _kill(srv: ServerProcess, actor: str) -> None:
    pids = subprocess.run(["pgrep", "-s", str(srv.proc.pid), "-f", f"ray::{actor}"], capture_output=True,
                          text=True).stdout.split()
    assert pids, f"no {actor} process"
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)


def _streams(address: str, results: list, started: threading.Barrier) -> list[threading.Thread]:
    def run(i):
        c = DSparkClient(address)
        ids = []
        try:
            for n, msg in enumerate(c.stream(PROMPTS[i], temperature=0.0, max_tokens=TOKENS, ignore_eos=True,
                                             timeout=120)):
                if msg.HasField("chunk"):
                    ids += msg.chunk.token_ids
                if n == 2:
                    started.wait()
            results[i] = ids
        except grpc.RpcError as e:
            results[i] = e
            if not started.broken:
                started.abort()
        finally:
            c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return threads


def test_a_killed_draft_actor_loses_nothing_and_is_replaced(pair_dirs, reference):
    srv = ServerProcess(*pair_dirs, "--no-colocate", "--channel-timeout", "5", "--keepalive", "1")
    c = DSparkClient(srv.address)
    try:
        results = [None] * len(PROMPTS)
        started = threading.Barrier(len(PROMPTS) + 1, timeout=60)
        threads = _streams(srv.address, results, started)
        started.wait()
        _kill(srv, "DraftActor")
        for t in threads:
            t.join(120)
        assert results == reference  # greedy: plain decoding from where speculation stopped gives the same tokens
        end = time.monotonic() + 30
        while not c.server_stats().speculating and time.monotonic() < end:
            time.sleep(0.2)
        assert c.server_stats().speculating
        out = c.generate(PROMPTS[0], temperature=0.0, max_tokens=40, ignore_eos=True)
        assert out["token_ids"] == reference[0][:40] and out["stats"]["drafted"] > 0 and out["stats"]["tau"] > 1.5
    finally:
        c.close()
        srv.kill()


def test_a_killed_verifier_fails_cleanly_and_a_new_pair_serves(pair_dirs, reference):
    srv = ServerProcess(*pair_dirs)
    c = DSparkClient(srv.address)
    try:
        stream = c.stream(PROMPTS[1], temperature=0.0, max_tokens=3000, ignore_eos=True, timeout=60)
        next(stream)
        _kill(srv, "VerifierActor")
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        details = e.value.details()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "unavailable" in details
        assert not any(word in details.lower() for word in ("actor", "pid", "127.0.0.1", "ray", "node"))
        end = time.monotonic() + 90
        while c.health() != "NOT_SERVING" and time.monotonic() < end:
            time.sleep(0.05)
        while c.health() != "SERVING" and time.monotonic() < end:
            time.sleep(0.2)
        assert c.health() == "SERVING"
        out = c.generate(PROMPTS[1], temperature=0.0, max_tokens=40, ignore_eos=True, timeout=60)
        assert out["token_ids"] == reference[1][:40]
    finally:
        c.close()
        srv.kill()


class _Handle:
    """An in-process VerifierActor behind the shape of a Ray actor handle (`handle.method.remote(...)`)."""

    def __init__(self, actor) -> None:
        self._actor = actor

    def __getattr__(self, name):
        method = getattr(self._actor, name)

        class Remote:
            @staticmethod
            def remote(*args):
                return asyncio.get_running_loop().run_in_executor(None, method, *args)

        return Remote


def test_a_failed_step_loop_ends_every_open_stream_at_once(pair_dirs, monkeypatch):
    """The loop raises mid-decode (the failure injected into its engine): every open stream gets UNAVAILABLE
    within a step, health reads NOT_SERVING, new requests are refused."""
    from dspark_serve.actors.verifier_actor import VerifierActor
    from dspark_serve.cluster.config import GatewayConfig, PairConfig
    from dspark_serve.cluster.grpc_server import GatewayServer
    from dspark_serve.engine.engine_config import EngineConfig

    actor = VerifierActor(PairConfig(EngineConfig(target=str(pair_dirs[0]), draft=str(pair_dirs[1]), device="cpu",
                                                  num_kv_blocks=256, block_size=8),
                                     colocate=True, channel_host="127.0.0.1"))
    actor.start()
    step = actor.llm.core.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] > 12:
            raise RuntimeError("injected device fault")
        return step()

    monkeypatch.setattr(actor.llm.core, "step", failing_step)
    errors, ended = [], []

    async def main():
        server = GatewayServer(_Handle(actor), GatewayConfig(port=0))
        port = await server.start()
        loop = asyncio.get_running_loop()

        def one(i):
            c = DSparkClient(f"127.0.0.1:{port}")
            try:
                list(c.stream(PROMPTS[i], temperature=0.0, max_tokens=1500, ignore_eos=True, timeout=30))
            except grpc.RpcError as e:
                errors.append((e.code(), e.details()))
                ended.append(time.monotonic())
            finally:
                c.close()

        await asyncio.gather(*(loop.run_in_executor(None, one, i) for i in range(3)))
        health = actor.health()

        def refused():
            c = DSparkClient(f"127.0.0.1:{port}")
            try:
                c.generate(PROMPTS[0], max_tokens=4, timeout=10)
            except grpc.RpcError as e:
                return e.code()
            finally:
                c.close()

        late = await loop.run_in_executor(None, refused)
        await server.stop()
        return health, late

    health, late = asyncio.run(main())
    assert late == grpc.StatusCode.UNAVAILABLE
    assert [code for code, _ in errors] == [grpc.StatusCode.UNAVAILABLE] * 3
    assert all("injected" not in d and "Traceback" not in d for _, d in errors)
    assert max(ended) - min(ended) < 2.0
    assert not health["ok"] and "injected device fault" in health["error"]


def test_the_step_loop_reports_its_failure_on_the_request_stream(pair_dirs, monkeypatch):
    from dspark_serve.actors.verifier_actor import VerifierActor
    from dspark_serve.cluster.config import PairConfig
    from dspark_serve.engine.engine_config import EngineConfig

    actor = VerifierActor(PairConfig(EngineConfig(target=str(pair_dirs[0]), draft=str(pair_dirs[1]), device="cpu",
                                                  num_kv_blocks=256, block_size=8),
                                     colocate=True, channel_host="127.0.0.1"))
    actor.start()
    monkeypatch.setattr(actor.llm.core, "step", lambda: (_ for _ in ()).throw(RuntimeError("injected")))
    client = SyncStreamClient(*actor.stream_address())
    client.send(Add("a", [1, 2, 3], {"temperature": 0.0, "max_tokens": 8}))
    assert client.recv() == Fatal("the step loop failed")
    assert actor.wait_stopped() is not None and not actor.health()["ok"]
    client.close()
