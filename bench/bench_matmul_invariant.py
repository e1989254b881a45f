"""The deterministic mode's batch-invariant matmul at the target's projection shapes, inside CUDA graphs (as a step
runs it): microseconds per call by M for each tile choice of `config_for` (K split until one row tile's programs
reach P, tiles of BN output columns), against cuBLAS (F.linear, not batch-invariant); then per choice the sum over
one step's projections (every layer's four and the lm_head), the number a choice is picked by.

usage: python bench/bench_matmul_invariant.py [--models 0.5b 8b] [--ms 1 8 64 512] [--programs 0 64 128 256]
       [--block-n 16 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # (name, N, K) of one decoder layer's projections and the lm_head
    "0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864),
             ("lm_head", 151936, 896)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}
LAYERS = {"0.5b": 24, "8b": 36}
CALLS = 20  # calls per recorded graph


def graph_us(fn) -> float:
    """Microseconds per call of fn() replayed in a CUDA graph of CALLS calls (the best of 20 replays)."""
    from dspark_serve.engine.runner.capture import device_ms

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return device_ms(graph.replay, 20) * 1e3 / CALLS


def main(argv: list[str] | None = None) -> dict:
    from dspark_serve.kernels.matmul_invariant import config_for, matmul_invariant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["0.5b", "8b"])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--programs", type=int, nargs="+", default=[0, 64, 128, 256])
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    choices = [(p, bn) for bn in args.block_n for p in args.programs]
    rows, steps = [], []
    for model in args.models:
        for name, n, k in SHAPES[model]:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = {"model": model, "proj": name, "n": n, "k": k, "m": m,
                       "cublas_us": graph_us(lambda: F.linear(x, w))}
                for p, bn in choices:
                    cfg = config_for(n, k, p, bn)
                    row[f"P{p}_BN{bn}_us"] = graph_us(lambda: matmul_invariant(x, w, config=cfg))
                    row[f"P{p}_BN{bn}_pieces"] = -(-k // (cfg.k_split or k))
                rows.append(row)
                print(f"{model:>5} {name:>8} {n:>6}x{k:<5} M={m:<4} cuBLAS {row['cublas_us']:7.1f} us  "
                      + "  ".join(f"P{p}/BN{bn}: {row[f'P{p}_BN{bn}_us']:7.1f}" for p, bn in choices), flush=True)
            del w
        for m in args.ms:
            mine = [r for r in rows if r["model"] == model and r["m"] == m]
            per = lambda key: sum(r[key] * (1 if r["proj"] == "lm_head" else LAYERS[model]) for r in mine)  # noqa
            steps.append({"model": model, "m": m, "cublas_us": per("cublas_us"),
                          **{f"P{p}_BN{bn}_us": per(f"P{p}_BN{bn}_us") for p, bn in choices}})
    print("\none step's projections (every layer's four and the lm_head), us:")
    print("| model | M | cuBLAS | " + " | ".join(f"P{p} BN{bn}" for p, bn in choices) + " |")
    for s in steps:
        print(f"| {s['model']} | {s['m']} | {s['cublas_us']:.0f} | "
              + " | ".join(f"{s[f'P{p}_BN{bn}_us']:.0f}" for p, bn in choices) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows,
                                               "steps": steps}, indent=2))
    return {"rows": rows, "steps": steps}


if __name__ == "__main__":
    main()
