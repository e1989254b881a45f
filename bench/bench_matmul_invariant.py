"""The deterministic mode's batch-invariant matmul at the target's projection shapes: microseconds per call (the best
of 50) by M, for each K split (0: K walked whole by every program), against cuBLAS (F.linear, not batch-invariant).

usage: python bench/bench_matmul_invariant.py [--models 0.5b 8b] [--ms 1 8 64 512] [--k-split 1024 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # (name, N, K) of one decoder layer's projections and the lm_head
    "0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864),
             ("lm_head", 151936, 896)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}


def time_us(fn, iters: int = 50) -> float:
    """The best of `iters` device times of fn(), in microseconds."""
    from dspark_serve.engine.runner.capture import device_ms

    for _ in range(4):
        fn()
    return device_ms(fn, iters) * 1e3


def main(argv: list[str] | None = None) -> dict:
    from dspark_serve.kernels.matmul_invariant import CONFIG, matmul_invariant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["0.5b", "8b"])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--k-split", type=int, nargs="+", default=[1024, 0])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for model in args.models:
        for name, n, k in SHAPES[model]:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = {"model": model, "proj": name, "n": n, "k": k, "m": m,
                       "cublas_us": time_us(lambda: F.linear(x, w))}
                for s in args.k_split:
                    cfg = replace(CONFIG, k_split=s)
                    row[f"split{s}_us"] = time_us(lambda: matmul_invariant(x, w, config=cfg))
                rows.append(row)
                print(f"{model:>5} {name:>8} {n:>6}x{k:<5} M={m:<4} cuBLAS {row['cublas_us']:8.1f} us  "
                      + "  ".join(f"split {s}: {row[f'split{s}_us']:8.1f} us" for s in args.k_split), flush=True)
            del w
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return {"rows": rows}


if __name__ == "__main__":
    main()
