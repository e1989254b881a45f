"""The deterministic mode's batch-invariant matmul at the target's projection shapes, inside CUDA graphs (as a step
runs it): microseconds per call by M for each tile choice of `config_for` (K split until one row tile's programs
reach P, tiles of N output columns, K steps of K, W warps), against cuBLAS (F.linear, not batch-invariant); then per choice the sum over
one step's projections (every layer's four and the lm_head), the number a choice is picked by.

usage: python bench/bench_matmul_invariant.py [--models 0.5b 8b] [--ms 1 8 64 512] [--programs 0 128]
       [--block-n 16 32] [--block-k 64 128 256] [--warps 2 4] [--json OUT]
A choice is named P<programs>/N<block_n>/K<block_k>/W<warps>: the KernelConfig fields invariant_programs,
invariant_block_n, invariant_block_k and invariant_warps.
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
    from dspark_serve.engine.runner.capture import capture, device_ms

    replay, _ = capture(lambda: [fn() for _ in range(CALLS)])
    return device_ms(replay, 20) * 1e3 / CALLS


def main(argv: list[str] | None = None) -> dict:
    from dataclasses import replace

    from dspark_serve.kernels.matmul_invariant import CONFIG, config_for, matmul_invariant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["0.5b", "8b"])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--programs", type=int, nargs="+", default=[0, 128])
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    choices = {f"P{p}/N{bn}/K{bk}/W{w}": (p, bn, replace(CONFIG, block_k=bk, num_warps=w))
               for p in args.programs for bn in args.block_n for bk in args.block_k for w in args.warps}
    rows, steps = [], []
    for model in args.models:
        for name, n, k in SHAPES[model]:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = {"model": model, "proj": name, "n": n, "k": k, "m": m,
                       "us": {"cuBLAS": graph_us(lambda: F.linear(x, w))}}
                for label, (p, bn, base) in choices.items():
                    cfg = config_for(n, k, p, bn, base)
                    row["us"][label] = graph_us(lambda: matmul_invariant(x, w, config=cfg))
                rows.append(row)
                best = min(choices, key=row["us"].get)
                print(f"{model:>5} {name:>8} {n:>6}x{k:<5} M={m:<4} cuBLAS {row['us']['cuBLAS']:7.1f} us  "
                      f"P0/N32/K128/W4 {row['us'].get('P0/N32/K128/W4', float('nan')):7.1f}  best {best} "
                      f"{row['us'][best]:7.1f}", flush=True)
            del w
        for m in args.ms:
            mine = [r for r in rows if r["model"] == model and r["m"] == m]
            times = lambda r: 1 if r["proj"] == "lm_head" else LAYERS[model]  # noqa: E731
            steps.append({"model": model, "m": m,
                          "us": {c: sum(r["us"][c] * times(r) for r in mine) for c in ["cuBLAS", *choices]}})
    print("\none step's projections (every layer's four and the lm_head), us; the 8 best choices at the first M:")
    for model in args.models:
        mine = [s for s in steps if s["model"] == model]
        order = sorted(choices, key=mine[0]["us"].get)[:8]
        if "P0/N32/K128/W4" in choices and "P0/N32/K128/W4" not in order:
            order.append("P0/N32/K128/W4")
        print(f"| {model} | " + " | ".join(f"M = {s['m']}" for s in mine) + " |")
        for c in ["cuBLAS", *order]:
            print(f"| {c} | " + " | ".join(f"{s['us'][c]:.0f}" for s in mine) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows,
                                               "steps": steps}, indent=2))
    return {"rows": rows, "steps": steps}


if __name__ == "__main__":
    main()
