"""What one step exchange costs: the verifier<->draft step channel (gloo on CPU, NCCL on two GPUs) vs a Ray call.

usage: python bench/bench_channel.py [--device cpu|cuda] [--iters 200] [--json OUT]
Two Ray actors (one GPU each with --device cuda) exchange real DraftInput / DraftProposal messages through
actors/channel.py; the draft side answers instantly, so the time is the channel's. Shapes are Qwen3-8B's:
features 5 x 4096 per new token, block 7, vocab 151936.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ray
import torch

from dspark_serve.actors.channel import DraftEnd, VerifierEnd, free_port
from dspark_serve.engine.drafter import DraftInput, DraftProposal

CTX_DIM, N, VOCAB = 5 * 4096, 7, 151936
CASES = [  # (name, requests, new tokens per request, q candidates per position: 0 = greedy, no q)
    ("greedy, 1 req, 8 new tokens", 1, 8, 0),
    ("sampled top-k 64, 1 req, 8 new tokens", 1, 8, 64),
    ("greedy, 8 reqs, 8 new tokens each", 8, 8, 0),
    ("sampled top-k 64, 32 reqs, 4 new tokens each", 32, 4, 64),
]


@ray.remote
class Peer:
    def __init__(self, device: str) -> None:
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.end = None

    def address(self) -> tuple[str, int]:
        host = "127.0.0.1" if self.backend == "gloo" else ray.util.get_node_ip_address()
        return host, free_port(host)

    def connect(self, rank: int, host: str, port: int, topk: int) -> bool:
        if rank == 0:
            self.end = VerifierEnd(host, port, self.backend, self.device, CTX_DIM, torch.bfloat16, VOCAB)
        else:
            self.end = DraftEnd(host, port, self.backend, self.device, CTX_DIM, torch.bfloat16)
        return True

    def serve(self, topk: int) -> str:
        def propose(inp: DraftInput) -> DraftProposal:
            r = inp.anchors.shape[0]
            tokens = torch.zeros(r, N, dtype=torch.int64, device=self.device)
            cand = torch.arange(topk, device=self.device).expand(r, N, topk) if topk else None
            probs = torch.full((r, N, topk), 1.0 / topk, device=self.device) if topk else None
            return DraftProposal(tokens, None, torch.zeros(r, N, device=self.device), cand_ids=cand, cand_probs=probs)
        self.end.serve(propose)
        return "done"

    def exchange(self, reqs: int, new_tokens: int, iters: int) -> dict:
        dev = self.device
        inp = DraftInput(anchors=torch.ones(reqs, dtype=torch.int64), anchor_pos=torch.full((reqs,), 100),
                         ctx_start=torch.full((reqs,), 100 - new_tokens), ctx_len=torch.full((reqs,), new_tokens),
                         features=torch.randn(reqs * new_tokens, CTX_DIM, device=dev, dtype=torch.bfloat16),
                         block_table=torch.arange(reqs * 8).view(reqs, 8), temperature=torch.ones(reqs),
                         seeds=torch.arange(reqs))
        times = []
        for i in range(iters + 10):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = self.end.propose(inp)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= 10:
                times.append((time.perf_counter() - t0) * 1e3)
        assert out.tokens.shape == (reqs, N)
        return {"median_ms": statistics.median(times), "p90_ms": sorted(times)[int(0.9 * len(times))]}

    def stop(self) -> bool:
        self.end.stop()
        self.end.close()
        return True

    def ping(self, payload: torch.Tensor) -> int:
        return payload.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **({} if args.device == "cuda" else {
        "_node_ip_address": "127.0.0.1", "runtime_env": {"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}}))
    opts = {"num_cpus": 1, "max_concurrency": 4, **({"num_gpus": 1} if args.device == "cuda" else {})}
    rows = []
    for name, reqs, new_tokens, topk in CASES:
        verifier, draft = Peer.options(**opts).remote(args.device), Peer.options(**opts).remote(args.device)
        host, port = ray.get(verifier.address.remote())
        ray.get([verifier.connect.remote(0, host, port, topk), draft.connect.remote(1, host, port, topk)])
        draft.serve.remote(topk)
        print(f"{name}: connected", flush=True)
        r = ray.get(verifier.exchange.remote(reqs, new_tokens, args.iters))
        ray.get(verifier.stop.remote())
        payload = torch.randn(reqs * new_tokens, CTX_DIM).to(torch.bfloat16)
        rtt = []
        for i in range(args.iters // 4 + 5):
            t0 = time.perf_counter()
            ray.get(draft.ping.remote(payload))
            if i >= 5:
                rtt.append((time.perf_counter() - t0) * 1e3)
        r.update(case=name, bytes_to_draft=reqs * new_tokens * CTX_DIM * 2, ray_call_ms=statistics.median(rtt))
        rows.append(r)
        print(f"{r['case']:<46} channel {r['median_ms']:8.3f} ms (p90 {r['p90_ms']:.3f})  "
              f"Ray call {r['ray_call_ms']:8.3f} ms", flush=True)
        ray.kill(verifier)
        ray.kill(draft)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "gpus": torch.cuda.device_count(), "rows": rows,
                       "host_cpus": os.cpu_count()}, f, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
