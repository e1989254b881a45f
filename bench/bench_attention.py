"""The Triton paged attention at decode / verify shapes: the default config against a sweep of key tile, key
splits and warps (each checked against the default's output first), µs per call from a CUDA graph of 50 calls.

usage: python bench/bench_attention.py [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import asdict, replace

import torch

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.kernels.paged_attention_triton import default_attention_config, paged_attention_triton

# name: (requests, kv heads, group, head_dim, query tokens per request, keys seen, context bucket)
SHAPES = {
    "0.5b decode b1 ctx 230": (1, 2, 7, 64, 1, 230, 256),
    "0.5b decode b1 ctx 460": (1, 2, 7, 64, 1, 460, 512),
    "0.5b verify 8 b1 ctx 230": (1, 2, 7, 64, 8, 230, 256),
    "0.5b verify 8 b1 ctx 460": (1, 2, 7, 64, 8, 460, 512),
    "0.5b decode b8 ctx 230": (8, 2, 7, 64, 1, 230, 256),
    "0.5b verify 8 b8 ctx 230": (8, 2, 7, 64, 8, 230, 256),
    "0.5b decode b64 ctx 230": (64, 2, 7, 64, 1, 230, 256),
    "8b decode b1 ctx 500": (1, 8, 4, 128, 1, 500, 512),
    "8b verify 8 b1 ctx 500": (1, 8, 4, 128, 8, 500, 512),
    "8b decode b8 ctx 500": (8, 8, 4, 128, 1, 500, 512),
}
BLOCK_SIZE = 16


def make(reqs: int, kv: int, group: int, d: int, q_len: int, seq: int, bucket: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per = bucket // BLOCK_SIZE
    cache = torch.randn(2, reqs * blocks_per + 1, BLOCK_SIZE, kv, d, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(reqs * blocks_per, device="cuda", generator=g)
    meta = AttentionMetadata(cu_seqlens_q=torch.arange(reqs + 1, device="cuda") * q_len,
                             seq_lens=torch.full((reqs,), seq, device="cuda"),
                             slot_mapping=torch.zeros(reqs * q_len, dtype=torch.int64, device="cuda"),
                             block_table=perm.view(reqs, blocks_per), max_query_len=q_len, max_seq_len=bucket,
                             causal=True, all_slots_valid=True)
    q = torch.randn(reqs * q_len, kv * group, d, device="cuda", generator=g).bfloat16()
    return q, cache[0], cache[1], meta, d ** -0.5


def graph_us(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = math.inf
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for name, shape in SHAPES.items():
        reqs, kv, group, d, q_len, seq, bucket = shape
        q, k, v, meta, scale = make(*shape)
        base = default_attention_config(reqs, kv, group, d, q_len, bucket)
        ref = paged_attention_triton(q, k, v, meta, scale, base)
        default_us = graph_us(lambda: paged_attention_triton(q, k, v, meta, scale, base))
        best = (default_us, base)
        for block_n, split, warps in itertools.product((16, 32, 64), (1, 2, 4, 8, 16), (2, 4)):
            if block_n * split > 2 * bucket:
                continue
            cfg = replace(base, block_n=block_n, num_splits=split, num_warps=warps)
            try:
                out = paged_attention_triton(q, k, v, meta, scale, cfg)
            except Exception as e:  # a config the compiler rejects (registers): skip it
                print(f"  {name}: {cfg} failed: {type(e).__name__}")
                continue
            if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                raise AssertionError(f"{name}: {cfg} disagrees with the default config")
            us = graph_us(lambda: paged_attention_triton(q, k, v, meta, scale, cfg))
            best = min(best, (us, cfg), key=lambda x: x[0])
        rows.append({"shape": name, "default_us": default_us, "default": asdict(base), "best_us": best[0],
                     "best": asdict(best[1])})
        b = best[1]
        print(f"{name:26} default {default_us:7.2f} us (split {base.num_splits}, block_n {base.block_n}) | best "
              f"{best[0]:7.2f} us: block_m {b.block_m} block_n {b.block_n} split {b.num_splits} warps {b.num_warps}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
