"""Several gateway processes on one step loop (`--api-server-count`): the step loop answers each gateway for its own
sequences only and ends a gone gateway's; the service spreads client connections over its gateway processes,
merges their metrics, re-points them all at a new pair, starts a dead one again, and stops them all on SIGTERM."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import grpc
from service import ServerProcess
from test_faults import _kill

from dspark_serve.actors.frames import Abort, Add, Rejected, Step
from dspark_serve.actors.request_stream import SyncStreamClient
from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb
from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def _outputs(client: SyncStreamClient, want: set[str], rejections: int = 0) -> tuple[dict[str, list], list]:
    """Every Output the client receives until each of `want` has finished and `rejections` Rejected frames came:
    (rid -> its outputs, the Rejected frames)."""
    got: dict[str, list] = {}
    done: set[str] = set()
    rejected: list[Rejected] = []
    while not (want <= done and len(rejected) >= rejections):
        frame = client.recv()
        if isinstance(frame, Rejected):
            rejected.append(frame)
            continue
        assert isinstance(frame, Step)
        for out in frame.outputs:
            got.setdefault(out.request_id, []).append(out)
            if out.finish_reason is not None:
                done.add(out.request_id)
    return got, rejected


def test_each_gateway_gets_only_its_own_sequences_and_a_gone_one_loses_only_its_own(tmp_path):
    from dspark_serve.actors.verifier_actor import VerifierActor
    from dspark_serve.cluster.config import PairConfig
    from dspark_serve.engine.engine_config import EngineConfig

    target, draft = random_pair(tmp_path, agree=0.5, block_size=6)
    actor = VerifierActor(PairConfig(EngineConfig(target=str(target), draft=str(draft), device="cpu",
                                                  num_kv_blocks=256, block_size=8),
                                     colocate=True, channel_host="127.0.0.1"))
    actor.start()
    a, b = SyncStreamClient(*actor.stream_address()), SyncStreamClient(*actor.stream_address())
    try:
        a.send(Add("a1", [3, 1, 4], GREEDY))
        b.send(Add("b1", [2, 7, 1], GREEDY))
        a.send(Add("a2", [1, 5, 9], GREEDY))
        b.send(Abort(["a2"]))  # another gateway's sequence: not b's to end
        b.send(Add("a2", [1, 5, 9], GREEDY))  # nor its id to take
        (got_a, _), (got_b, rejected) = _outputs(a, {"a1", "a2"}), _outputs(b, {"b1"}, rejections=1)
        assert rejected == [Rejected("a2", "request id 'a2' is already running")]
        assert set(got_a) == {"a1", "a2"} and set(got_b) == {"b1"}
        assert [sum(len(o.new_token_ids) for o in got_a[r]) for r in ("a1", "a2")] == [8, 8]
        assert got_a["a2"][-1].finish_reason == "length"

        long = actor.model_info()["max_model_len"] - 3
        b.send(Add("b2", [2, 7, 1], {**GREEDY, "max_tokens": long}))
        assert sum(len(o.new_token_ids) for o in b.recv().outputs) == 1  # running
        b.close()  # its gateway is gone: b2 ends, a3 runs to its end
        a.send(Add("a3", [3, 1, 4], GREEDY))
        got, _ = _outputs(a, {"a3"})
        assert set(got) == {"a3"} and sum(len(o.new_token_ids) for o in got["a3"]) == 8
        end = time.monotonic() + 30
        while actor.stats()["num_running"] and time.monotonic() < end:
            time.sleep(0.01)
        s = actor.stats()
        assert s["num_running"] == 0 and s["free_target_blocks"] == s["total_target_blocks"]
    finally:
        a.close()
        actor.shutdown()


def _own_connection(address: str) -> grpc.Channel:
    """A channel with a connection of its own (grpc otherwise shares one between a process's channels)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _generate_on_own_connections(address: str, n: int) -> list[tuple[int, int, int]]:
    """n requests, each on its own connection, all in flight together; -> per request (tokens, that gateway's
    finished count read on the same connection before and after)."""
    channels = [_own_connection(address) for _ in range(n)]
    try:
        stubs = [dspark_pb2_grpc.GenerationStub(ch) for ch in channels]
        count = lambda stub: sum(stub.GetServerStats(pb.GetServerStatsRequest(),  # noqa: E731
                                                     timeout=10).finished_by_reason.values())
        before = [count(stub) for stub in stubs]
        req = lambda i: DSparkClient.request([3, 1, 4, i], temperature=0.0, max_tokens=12,  # noqa: E731
                                             ignore_eos=True)
        t0 = time.monotonic()
        calls = [stub.Generate(req(i), timeout=60) for i, stub in enumerate(stubs)]
        finals = [list(call)[-1].complete for call in calls]
        waited_ms = 1e3 * (time.monotonic() - t0)
        for f in finals:  # the gateway's own times: its Add, then the step loop's first token, then its first chunk
            s = f.stats
            assert 0 < s.gateway_intake_ms < s.gateway_intake_ms + s.first_token_ms <= s.gateway_first_token_ms
            assert s.gateway_first_token_ms < waited_ms
        tokens = [len(f.output_ids) for f in finals]
        return list(zip(tokens, before, [count(stub) for stub in stubs]))
    finally:
        for ch in channels:
            ch.close()


def _requests_counted(http_address: str) -> float:
    text = urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dspark:request_success_total{"))


def test_a_service_of_two_gateway_processes_spreads_merges_recovers_and_stops(tmp_path):
    target, draft = random_pair(tmp_path, agree=0.5, block_size=6)
    srv = ServerProcess(target, draft, "--http-port", "0", "--api-server-count", "2", "--drain-timeout", "2")
    try:
        results = _generate_on_own_connections(srv.address, 16)
        assert [r[0] for r in results] == [12] * 16
        # each process counts what it served: neither served all 16, so both took connections
        assert max(r[2] for r in results) < 16, results
        for i in range(4):  # HTTP too: a connection per request, any process answers
            body = json.dumps({"model": str(target), "prompt": [3, 1, 4, i], "max_tokens": 5, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://{srv.http_address}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
            assert answer["usage"]["completion_tokens"] == 5
        assert _requests_counted(srv.http_address) == 20  # every process's counts, whichever answers /metrics

        _kill(srv, "VerifierActor")  # a new pair: every gateway process is pointed at it
        c = DSparkClient(srv.address)
        end = time.monotonic() + 90
        while c.health() == "SERVING" and time.monotonic() < end:
            time.sleep(0.05)
        while c.health() != "SERVING" and time.monotonic() < end:
            time.sleep(0.2)
        c.close()
        time.sleep(1.0)  # the other process's health follows within its probe period
        results = _generate_on_own_connections(srv.address, 8)
        assert [r[0] for r in results] == [12] * 8

        # a gateway process that dies is started again; until then its port-mates take the new connections
        spawned = subprocess.run(["pgrep", "-s", str(srv.proc.pid), "-f", "multiprocessing.spawn"],
                                 capture_output=True, text=True).stdout.split()
        assert len(spawned) == 1, spawned
        os.kill(int(spawned[0]), signal.SIGKILL)
        end = time.monotonic() + 60
        while "was started again" not in "".join(srv.log) and time.monotonic() < end:
            time.sleep(0.1)
        assert "gateway process 1 died and was started again" in "".join(srv.log)
        results = _generate_on_own_connections(srv.address, 16)
        assert [r[0] for r in results] == [12] * 16
        assert any(r[1] == 0 for r in results), results  # the new process, which had served nothing, took some

        srv.terminate()
        assert srv.wait(60) == 0
        with socket.socket() as s:  # no gateway process is left listening
            assert s.connect_ex(("127.0.0.1", int(srv.address.rsplit(":", 1)[1]))) != 0
    finally:
        srv.kill()
