"""Many replicas through real Ray Serve on a two-node local Ray cluster (ray.cluster_utils.Cluster): two replicas of
the tiny pair behind Serve's gRPC and HTTP proxies with the prefix-affinity router; multi-turn conversations return
to the replica holding their cache; a replica out of balance sheds new requests; a SIGKILLed replica ends only its
own streams; and an autoscaled deployment goes 1 -> 2 replicas under a queue and back to 1 when idle."""

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
IMBALANCE = 3
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
    yield client, http_port
    client.close()
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def _call(client: DSparkClient, prompt, session: str = "", **kw) -> dict:
    """One streamed request: its replica (trailing metadata), prompt and cached tokens, and when it ended."""
    metadata = list(client.metadata) + ([("session_id", session)] if session else [])
    call = client.stub.Generate(client.request(prompt, temperature=0.0, **kw), metadata=metadata,
                                timeout=kw.pop("timeout", 120))
    out = {"tokens": []}
    try:
        for msg in call:
            if msg.HasField("chunk"):
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
    replicas = {r["replica"] for r in follow_ups}
    print(f"multi-turn: {share:.1%} of {len(follow_ups)} follow-ups with >= half cached; replicas {replicas}")
    assert len(replicas) == 2 and None not in replicas
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
