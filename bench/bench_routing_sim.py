"""Router simulation: a multi-turn chat trace replayed over 2..256 replicas, the prefix-affinity policy the Serve router
runs (cluster/affinity.py, unchanged) against power-of-two choices; prefix-cache hit rate and load balance.

Assumptions (a trace *shape*, not a recorded trace; every number is a flag):
- conversations: turns ~ geometric, mean 3.5, at most 16 (ShareGPT's multi-turn shape, as SGLang's and vLLM's
  multi-turn benchmarks draw it); user turns lognormal, median 60 tokens; answers lognormal, median 200 tokens.
- system prompts of 600 tokens: 70 % of conversations take one of 64 shared prompts (Zipf, s = 1.1), 30 % their own.
- arrivals: conversations start as a Poisson process sized so a replica has `--load` requests in flight on average;
  a conversation's next turn comes an exponential think time (mean 5 s) after its answer.
- a request's time: 0.05 ms per uncached prompt token + 20 ms per output token (continuous batching: independent of
  the batch); each replica's prefix cache: LRU over 16-token blocks, `--cache-blocks` of them.
- load: each replica's work (sum of its requests' times), max / mean over replicas. Ideal hit rate: every prompt
  finds all of its earlier-seen prefix (one unbounded cache for all, so also every conversation on one replica).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time
from collections import OrderedDict

from dspark_serve.cluster.affinity import AffinityConfig, AffinityTable, choose, less_loaded_of_two

BLOCK = 16


class Cache:
    """One replica's prefix cache: LRU over block keys."""

    def __init__(self, blocks: int) -> None:
        self.blocks, self.lru = blocks, OrderedDict()

    def hit(self, keys: list) -> int:
        n = 0
        for k in keys:
            if k not in self.lru:
                break
            n += 1
        for k in keys:
            self.lru[k] = None
            self.lru.move_to_end(k)
        while len(self.lru) > self.blocks:
            self.lru.popitem(last=False)
        return n


def conversations(n: int, rng: random.Random, args: argparse.Namespace) -> list[dict]:
    zipf = [1 / (k + 1) ** 1.1 for k in range(64)]
    out = []
    for c in range(n):
        system = ("sys", rng.choices(range(64), zipf)[0]) if rng.random() < 0.7 else ("own", c)
        turns = min(16, 1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / 3.5)))
        out.append({"id": c, "system": system, "turns": [
            (max(4, int(rng.lognormvariate(math.log(60), 0.8))), max(4, int(rng.lognormvariate(math.log(200), 0.8))))
            for _ in range(turns)]})
    return out


def prompt_keys(conv: dict, turn: int) -> tuple[list, int]:
    """The prompt's block keys at `turn` (system, then the conversation's own text) and its length in tokens."""
    sys_tokens = 600
    own = sum(u + a for u, a in conv["turns"][:turn]) + conv["turns"][turn][0]
    tokens = sys_tokens + own
    keys = [(conv["system"], i) for i in range(sys_tokens // BLOCK)]
    keys += [(conv["id"], i) for i in range(sys_tokens // BLOCK, tokens // BLOCK)]  # after the system prompt: its own
    return keys, tokens


def simulate(replicas: int, policy: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    mean_s = 0.05e-3 * 700 + 20e-3 * 200
    rate = replicas * args.load / mean_s / 3.5  # conversations per second
    convs = conversations(args.conversations_per_replica * replicas, rng, args)
    events, t = [], 0.0  # (time, seq, conversation, turn): a turn arrives
    for i, c in enumerate(convs):
        t += rng.expovariate(rate)
        events.append((t, i, c["id"], 0))
    seq = len(events)
    loads = {r: 0 for r in range(replicas)}
    work = [0.0] * replicas
    caches = [Cache(args.cache_blocks) for _ in range(replicas)]
    seen: set = set()
    table, cfg = AffinityTable(1 << 22), AffinityConfig(imbalance_threshold=args.imbalance_threshold)
    hit = ideal = total = 0
    while events:
        now, _, cid, turn = heapq.heappop(events)
        if cid < 0:  # a request ends: (time, seq, -1 - replica, turn)
            loads[-1 - cid] -= 1
            continue
        conv = convs[cid]
        keys, tokens = prompt_keys(conv, turn)
        if policy == "prefix":
            r, _ = choose(keys, loads, table, cfg, rng)
            table.insert(keys, r)
        else:
            r = less_loaded_of_two(loads, rng)
        cached = caches[r].hit(keys) * BLOCK
        ideal += next((i for i, k in enumerate(keys) if k not in seen), len(keys)) * BLOCK
        seen.update(keys)
        hit, total = hit + cached, total + tokens
        out = conv["turns"][turn][1]
        dur = 0.05e-3 * (tokens - cached) + 20e-3 * out
        work[r] += dur
        loads[r] += 1
        seq += 1
        heapq.heappush(events, (now + dur, seq, -1 - r, 0))
        if turn + 1 < len(conv["turns"]):
            seq += 1
            heapq.heappush(events, (now + dur + rng.expovariate(1 / 5.0), seq, cid, turn + 1))
    mean = sum(work) / replicas
    return {"replicas": replicas, "policy": policy, "hit_rate": hit / total, "ideal_hit_rate": ideal / total,
            "max_over_mean_load": max(work) / mean}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 16, 64, 256])
    p.add_argument("--load", type=float, default=16, help="requests in flight per replica, on average")
    p.add_argument("--conversations-per-replica", type=int, default=40)
    p.add_argument("--cache-blocks", type=int, default=16384, help="prefix-cache blocks per replica (16 tokens each)")
    p.add_argument("--imbalance-threshold", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = []
    print(f"{'replicas':>8} {'policy':>12} {'hit rate':>9} {'ideal':>7} {'of ideal':>9} {'max/mean load':>14} {'s':>6}")
    for n in args.replicas:
        for policy in ("prefix", "power_of_two"):
            t0 = time.perf_counter()
            r = simulate(n, policy, args)
            rows.append(r)
            print(f"{n:>8} {policy:>12} {r['hit_rate']:>9.1%} {r['ideal_hit_rate']:>7.1%} "
                  f"{r['hit_rate'] / r['ideal_hit_rate']:>9.1%} {r['max_over_mean_load']:>14.3f} "
                  f"{time.perf_counter() - t0:>6.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
