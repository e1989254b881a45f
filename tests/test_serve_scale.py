"""Many replicas through real Ray Serve on a two-node local Ray cluster (ray.cluster_utils.Cluster): two replicas of
the tiny pair behind Serve's gRPC and HTTP proxies with the prefix-affinity router; multi-turn conversations return
to the replica holding their cache; a replica out of balance sheds new requests; a SIGKILLed replica ends only its
own streams; and an autoscaled deployment goes 1 -> 2 replicas under a queue and back to 1 when idle."""

import collections
import os
import signal
import socket
import threading
import time

import grpc
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from dspark_serve.cluster.grpc_client import DSparkClient  # noqa: E402
from dspark_serve.cluster.serve_app import REPLICA_HEADER, DSpark  # noqa: E402
from dspark_serve.cluster.serve_options import deployment_options  # noqa: E402

APP = "dspark"
ARGS = {"target": "builtin:tiny", "device": "cpu", "block_size": 8, "num_kv_blocks": 1024, "max_num_seqs": 16,
        "channel_host": "127.0.0.1", "num_cpus": 0.25, "cpu_threads": 1}
IMBALANCE = 2
CONVERSATIONS, TURNS, SYSTEM_CHARS = 8, 4, 1200  # ~600 tokens of the tiny byte-pair tokenizer each


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deploy(args: dict, **deployment) -> None:
    options, rest = deployment_options(args)
    serve.run(DSpark.options(**options, ray_actor_options={"num_cpus": 0.5},
                             **deployment).bind(**rest), name=APP, route_prefix="/")


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node (two cores each), Serve's proxies on free ports, two replicas."""
    from ray.cluster_utils import Cluster

    from ray.serve.config import gRPCOptions, HTTPOptions

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    grpc_port, http_port = _port(), _port()
    serve.start(proxy_location="HeadOnly", http_options=HTTPOptions(host="127.0.0.1", port=http_port),
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[
                    "dspark_serve.protos.dspark.v1.dspark_pb2_grpc.add_GenerationServicer_to_server"]))
    _deploy({**ARGS, "router": {"imbalance_threshold": IMBALANCE, "seed": 0}}, num_replicas=2)
    client = DSparkClient(f"127.0.0.1:{grpc_port}", application=APP)
    client.address = f"127.0.0.1:{grpc_port}"
    yield client, http_port
    client.close()
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def _call(client: DSparkClient, prompt, session: str = "", timeout: float = 120, started=None, **kw) -> dict:
    """One streamed request: its replica (trailing metadata), prompt and cached tokens, and when it ended."""
    metadata = list(client.metadata) + ([("session_id", session)] if session else [])
    call = client.stub.Generate(client.request(prompt, temperature=0.0, **kw), metadata=metadata, timeout=timeout)
    out = {"tokens": []}
    try:
        for msg in call:
            if msg.HasField("chunk"):
                if started is not None and not out["tokens"]:
                    started.release()
                out["tokens"] += list(msg.chunk.token_ids)
            elif msg.HasField("complete"):
                out.update(text=msg.complete.text, prompt=msg.complete.num_prompt_tokens,
                           cached=msg.complete.stats.cached_tokens)
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as e:
        out["code"] = e.code()
    out["end"] = time.monotonic()
    out["replica"] = dict(call.trailing_metadata() or ()).get(REPLICA_HEADER)
    return out


def _in_threads(fn, items) -> list:
    results = [None] * len(items)

    def run(i):
        results[i] = fn(items[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def multi_turn_hits(client: DSparkClient) -> tuple[float, list[dict]]:
    """CONVERSATIONS concurrent chats of TURNS turns, each with its own system prompt: the share of follow-up turns
    that found at least half of their prompt in the prefix cache, and every follow-up's result."""
    def conversation(i: int) -> list[dict]:
        system = "".join("etaoinshrdlucmfw"[(i * 7 + j * j) % 16] for j in range(SYSTEM_CHARS))
        messages, results = [{"role": "system", "content": f"{i}: {system}"}], []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"question {turn} of {i}"})
            r = _call(client, messages, max_tokens=6, ignore_eos=True)
            assert r["code"] == grpc.StatusCode.OK, r
            messages.append({"role": "assistant", "content": r["text"]})
            results.append(r)
        return results[1:]

    follow_ups = [r for rs in _in_threads(conversation, list(range(CONVERSATIONS))) for r in rs]
    return sum(r["cached"] >= r["prompt"] / 2 for r in follow_ups) / len(follow_ups), follow_ups


def test_conversations_return_to_their_cache(cluster):
    client, http_port = cluster
    share, follow_ups = multi_turn_hits(client)
    per = collections.Counter(r["replica"] for r in follow_ups)
    print(f"multi-turn: {share:.1%} of {len(follow_ups)} follow-ups with >= half cached; per replica {dict(per)}")
    assert len(per) == 2 and None not in per
    assert min(per.values()) >= len(follow_ups) / 4  # new conversations spread, even past a missed load probe
    assert share >= 0.9


def test_http_names_the_replica_and_sessions_stick(cluster):
    import httpx

    client, http_port = cluster
    body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    seen = {}
    for session in ("a", "b", "c", "d"):
        for _ in range(3):
            r = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body,
                           headers={"x-session-id": session}, timeout=60)
            assert r.status_code == 200, r.text
            seen.setdefault(session, []).append(r.headers[REPLICA_HEADER])
    assert all(len(set(v)) == 1 for v in seen.values()), seen  # a session stays on its replica


def test_bench_counts_requests_per_replica_and_cache_hits(cluster):
    import argparse

    from dspark_serve.cluster.commands.bench import run_level

    client, _ = cluster
    args = argparse.Namespace(prompt_file=None, num_requests=16, max_tokens=4, temperature=0.0)
    run_level(client.address, 4, args, {"application": APP})
    row = run_level(client.address, 4, args, {"application": APP})
    print(f"bench: per replica {row['per_replica']}, prefix-cache hit rate {row['prefix_cache_hit_rate']:.1%}")
    assert row["errors"] == 0 and sum(row["per_replica"].values()) == 16 and len(row["per_replica"]) == 2
    assert row["prefix_cache_hit_rate"] > 0.3  # the same 16 prompts again, each back on its replica


def test_a_replica_out_of_balance_sheds_new_requests(cluster):
    """12 long requests with one shared prompt at once: the holder takes them until it is IMBALANCE above the mean,
    then the less loaded of two gets the next (affinity alone would put all 12 on the holder)."""
    client, _ = cluster
    prompt = [(13 * j) % 500 + 1 for j in range(64)]
    assert _call(client, prompt, max_tokens=2)["code"] == grpc.StatusCode.OK  # the holder
    results = _in_threads(lambda _: _call(client, prompt, max_tokens=160, ignore_eos=True), list(range(12)))
    counts = sorted((sum(r["replica"] == k for r in results) for k in {r["replica"] for r in results}), reverse=True)
    print(f"shared prompt, 12 at once: per replica {counts}")
    assert all(r["code"] == grpc.StatusCode.OK for r in results)
    assert len(counts) == 2 and counts[0] - counts[1] <= 2 * IMBALANCE  # the holder at most IMBALANCE over the mean


def _replica_pids() -> dict[str, int]:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return {a.name.rsplit("#", 1)[-1]: a.pid for a in actors if a.class_name == f"ServeReplica:{APP}:DSpark"}


def test_a_killed_replica_ends_only_its_own_streams(cluster):
    """8 long streams over both replicas; SIGKILL one replica's process: its streams end within 30 s, the others
    finish, and 8 requests started after the kill all succeed."""
    client, _ = cluster
    pids = _replica_pids()
    assert len(pids) == 2, pids

    streaming = threading.Semaphore(0)

    def long_stream(i: int) -> dict:
        return _call(client, [i + 1, 7, 9], max_tokens=2500, ignore_eos=True, timeout=120, started=streaming)

    holder = []
    threads = [threading.Thread(target=lambda i=i: holder.append(long_stream(i))) for i in range(8)]
    for t in threads:
        t.start()
    for _ in threads:
        assert streaming.acquire(timeout=60)
    victim = sorted(pids)[0]
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    after = _in_threads(lambda i: _call(client, [i + 50, 3], max_tokens=8, timeout=60), list(range(8)))
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    mine = [r for r in holder if r["replica"] in (victim, None) and r["code"] != grpc.StatusCode.OK]
    others = [r for r in holder if r not in mine]
    ends = [r["end"] - killed_at for r in mine]
    print(f"kill: {len(mine)} streams of the killed replica ended after {[round(e, 2) for e in ends]} s "
          f"({[r['code'].name for r in mine]}); {len(others)} others {[r['code'].name for r in others]}; "
          f"after the kill {sum(r['code'] == grpc.StatusCode.OK for r in after)}/8 ok in "
          f"{max(r['end'] for r in after) - killed_at:.2f} s")
    assert mine and all(e < 30 for e in ends)
    assert all(r["code"] == grpc.StatusCode.OK for r in others)
    assert all(r["code"] == grpc.StatusCode.OK and r["replica"] != victim for r in after)


def test_autoscaling_adds_a_replica_under_a_queue_and_removes_it_when_idle(cluster):
    """max_num_seqs 2 (Serve's target: 2 ongoing a replica); 10 long requests -> 2 replicas; idle -> 1."""
    client, _ = cluster
    _deploy({**ARGS, "max_num_seqs": 2}, autoscaling_config={
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 1,
        "downscale_delay_s": 4, "metrics_interval_s": 0.5, "look_back_period_s": 2})
    _wait_for(lambda: _running() == 1, 60)

    t0 = time.monotonic()
    results = []
    load = threading.Thread(target=lambda: results.extend(_in_threads(
        lambda i: _call(client, [i + 1, 5], max_tokens=600, ignore_eos=True, timeout=240), list(range(10)))))
    load.start()
    up = _wait_for(lambda: _running() == 2, 120) - t0
    load.join(300)
    idle = time.monotonic()
    down = _wait_for(lambda: _running() == 1, 120) - idle
    print(f"autoscaling: 1 -> 2 replicas {up:.1f} s after the queue formed; 2 -> 1 {down:.1f} s after idle")
    assert up < 120 and down < 120
    assert len(results) == 10 and all(r["code"] == grpc.StatusCode.OK for r in results)  # scale-down lost none


def _running() -> int:
    app = serve.status().applications.get(APP)
    status = app and app.deployments.get("DSpark")
    return status.replica_states.get("RUNNING", 0) if status else 0


def _wait_for(cond, timeout_s: float) -> float:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.5)
    return time.monotonic()
