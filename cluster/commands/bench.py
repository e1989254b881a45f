"""`dspark-serve bench`: concurrent streaming clients against a running server; tokens/s, TTFT, TPOT and tau, the
prefix-cache hit rate, and the requests each Serve replica answered (its `x-dspark-replica` trailing metadata)."""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import threading
import time

import grpc

from ..grpc_client import DSparkClient

REPLICA_HEADER = "x-dspark-replica"  # serve_app.REPLICA_HEADER (not imported: that module needs Ray Serve)


def _prompts(path: str | None, n: int) -> list:
    if path is None:
        return [[(7 * i + j) % 200 + 1 for j in range(8 + i % 17)] for i in range(n)]
    lines = [ln.rstrip("\n") for ln in open(path, encoding="utf-8") if ln.strip()]
    parsed = [[int(t) for t in ln.split(",")] if all(p.strip().isdigit() for p in ln.split(",")) else ln
              for ln in lines]
    return [parsed[i % len(parsed)] for i in range(n)]


def _one(client: DSparkClient, prompt, args: argparse.Namespace, out: list) -> None:
    t0 = time.perf_counter()
    first = None
    tokens = 0
    stats = None
    prompt_tokens = 0
    call = client.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    try:
        for msg in call:
            if msg.HasField("chunk") and msg.chunk.token_ids:
                first = first or time.perf_counter()
                tokens = msg.chunk.num_output_tokens
            if msg.HasField("complete"):
                stats = msg.complete.stats
                prompt_tokens = msg.complete.num_prompt_tokens
    except grpc.RpcError as e:
        out.append({"error": e.code().name})
        return
    end = time.perf_counter()
    out.append({"ttft_s": (first or end) - t0, "tpot_s": (end - (first or end)) / max(tokens - 1, 1),
                "tokens": tokens, "latency_s": end - t0, "steps": stats.num_spec_steps,
                "accepted": stats.num_accepted_tokens, "transfer_ms": stats.transfer_ms,
                "prompt_tokens": prompt_tokens, "cached_tokens": stats.cached_tokens,
                "replica": dict(call.trailing_metadata() or ()).get(REPLICA_HEADER, "-")})


def run_level(address: str, concurrency: int, args: argparse.Namespace, access: dict | None = None) -> dict:
    prompts = _prompts(args.prompt_file, args.num_requests)
    results: list = []
    lock = threading.Lock()
    todo = list(prompts)

    def worker() -> None:
        client = DSparkClient(address, **(access or {}))
        while True:
            with lock:
                if not todo:
                    break
                prompt = todo.pop()
            _one(client, prompt, args, results)
        client.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    steps = sum(r["steps"] for r in ok)
    return {"concurrency": concurrency, "requests": len(ok), "errors": len(results) - len(ok),
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_ms_p50": 1e3 * statistics.median(r["ttft_s"] for r in ok) if ok else None,
            "tpot_ms_p50": 1e3 * statistics.median(r["tpot_s"] for r in ok) if ok else None,
            "tau": (sum(r["accepted"] for r in ok) + steps) / max(steps, 1),
            "transfer_ms_per_step": sum(r["transfer_ms"] for r in ok) / max(steps, 1),
            "prefix_cache_hit_rate": sum(r["cached_tokens"] for r in ok) / max(sum(r["prompt_tokens"] for r in ok), 1),
            "per_replica": dict(sorted(collections.Counter(r["replica"] for r in ok).items()))}


def main(args: argparse.Namespace, access: dict | None = None) -> int:
    """`access`: DSparkClient's tls, root_certificates and api_key."""
    rows = []
    for c in args.concurrency:
        rows.append(run_level(args.server, c, args, access))
        r = rows[-1]
        print(f"concurrency {c:>3}: {r['tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_ms_p50']:7.1f} ms  "
              f"TPOT p50 {r['tpot_ms_p50']:6.2f} ms  tau {r['tau']:.2f}  channel {r['transfer_ms_per_step']:.3f} "
              f"ms/step  cache hits {r['prefix_cache_hit_rate']:.1%}  errors {r['errors']}", flush=True)
        if len(r["per_replica"]) > 1 or "-" not in r["per_replica"]:
            print("  per replica: " + ", ".join(f"{k} {v}" for k, v in r["per_replica"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
