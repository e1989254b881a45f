"""Serve's default router against the prefix router through Ray Serve itself, on CPU: a two-node local Ray cluster
and two replicas of the tiny pair, as tests/test_serve_scale.py builds them; 8 concurrent conversations x 4 turns,
each with its own ~600-token system prompt. Each round starts a fresh Serve instance per router (a redeploy keeps a
deployment's first router), alternating. Reported per run: the share of follow-up turns with at least half of their
prompt cached, the follow-ups' hit rate, requests per replica and conversations that changed replica.

usage: RAY_AUTH_MODE=token PYTHONPATH=. python bench/bench_serve_routers.py [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def conversations(t, client, offset: int) -> dict:
    def one(i: int) -> list[dict]:
        system = "".join("etaoinshrdlucmfw"[(i * 7 + j * j) % 16] for j in range(t.SYSTEM_CHARS))
        messages, results = [{"role": "system", "content": f"{i}: {system}"}], []
        for turn in range(t.TURNS):
            messages.append({"role": "user", "content": f"question {turn} of {i}"})
            r = t._call(client, messages, max_tokens=6, ignore_eos=True)
            if r["code"] != t.grpc.StatusCode.OK:
                raise RuntimeError(f"conversation {i} turn {turn}: {r['code']}")
            messages.append({"role": "assistant", "content": r["text"]})
            results.append(r)
        return results

    runs = t._in_threads(one, [offset + k for k in range(t.CONVERSATIONS)])
    follow = [r for rs in runs for r in rs[1:]]
    return {"follow_ups_half_cached": sum(r["cached"] >= r["prompt"] / 2 for r in follow) / len(follow),
            "follow_up_hit_rate": sum(r["cached"] for r in follow) / sum(r["prompt"] for r in follow),
            "per_replica": sorted(collections.Counter(r["replica"] for rs in runs for r in rs).values()),
            "conversations_moved": sum(len({r["replica"] for r in rs}) > 1 for rs in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.config import gRPCOptions, HTTPOptions

    import test_serve_scale as t
    from dspark_serve.cluster.grpc_client import DSparkClient

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    rows, offset = [], 100
    routers = (("power_of_two", "power_of_two"), ("prefix", {"imbalance_threshold": t.IMBALANCE, "seed": 0}))
    try:
        for rnd in range(args.rounds):
            for name, router in routers:
                grpc_port = t._port()
                serve.start(proxy_location="HeadOnly", http_options=HTTPOptions(host="127.0.0.1", port=t._port()),
                            grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[
                                "dspark_serve.protos.dspark.v1.dspark_pb2_grpc.add_GenerationServicer_to_server"]))
                client = DSparkClient(f"127.0.0.1:{grpc_port}", application=t.APP)
                t._deploy({**t.ARGS, "router": router}, num_replicas=2)
                rows.append({"round": rnd, "router": name, **conversations(t, client, offset)})
                offset += 100
                print(json.dumps(rows[-1]), flush=True)
                client.close()
                serve.shutdown()
    finally:
        ray.shutdown()
        c.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
