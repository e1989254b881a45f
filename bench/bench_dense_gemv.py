"""The dense bf16 GEMV (kernels/gemv_bf16.py) against cuBLAS (F.linear) at the target's decode and verify rows, on
the Qwen3-8B and demo-pair (Qwen2.5-0.5B) projection shapes.
Each config is checked against F.linear first; times are CUDA-graph replays over weight copies larger than L2.

    python bench/bench_dense_gemv.py [--sweep] [--json out.json]
"""

import argparse
import json

import torch
import torch.nn.functional as F

from bench_nvfp4 import ROTATE_BYTES, copy_bandwidth_gbs, graph_time_us
from dspark_serve.kernels.gemv_bf16 import DenseGemvConfig, default_dense_gemv_config, gemv

SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)},
          "0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
                   "lm_head": (151936, 896)}}


def sweep(m: int) -> list[DenseGemvConfig]:
    if m == 1:
        tiles = ((8, 512, 4), (16, 256, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 8), (64, 256, 8))
        return [DenseGemvConfig(bn, bk, w) for bn, bk, w in tiles]
    tiles = ((16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4))
    return [DenseGemvConfig(bn, bk, w, st) for bn, bk, w, st in tiles]


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((got.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs()
                 + 1e-3 * ref.float().abs().max()).all())


def bench_shape(model: str, name: str, n: int, k: int, copy_gbs: float, do_sweep: bool) -> list[dict]:
    copies = max(1, min(32, ROTATE_BYTES // (2 * n * k)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    rows = []
    for m in (1, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])
        cublas_us = graph_time_us([lambda w=w: F.linear(x, w) for w in ws])
        results = []
        for cfg in dict.fromkeys([default_dense_gemv_config(m, n, k)] + (sweep(m) if do_sweep else [])):
            if not close(gemv(x, ws[0], config=cfg), ref):
                print(f"WRONG {model} {name} M={m} {cfg}")
                continue
            results.append((graph_time_us([lambda w=w, cfg=cfg: gemv(x, w, config=cfg) for w in ws]), cfg))
        us, cfg = results[0]
        best_us, best = min(results, key=lambda r: r[0])
        gbs = 2 * n * k / us / 1e3
        rows.append({"model": model, "shape": name, "N": n, "K": k, "M": m, "us": us, "GBps": gbs,
                     "pct_copy": 100 * gbs / copy_gbs, "cublas_us": cublas_us, "speedup_vs_cublas": cublas_us / us,
                     "best_us": best_us, "best_config": best.__dict__, "config": cfg.__dict__,
                     "all": [(t, c.__dict__) for t, c in results]})
        print(f"{model:5s} {name:8s} [{n:6d}, {k:5d}] M={m} gemv {us:7.2f} us ({100 * gbs / copy_gbs:5.1f}% of copy) "
              f"cuBLAS {cublas_us:7.2f} us x{cublas_us / us:4.2f} | best {best_us:7.2f} "
              f"[{best.block_n}, {best.block_k}, {best.num_warps}, {best.num_stages}]", flush=True)
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json")
    a = p.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write)")
    rows = [r for mdl in a.models for name, (n, k) in SHAPES[mdl].items()
            for r in bench_shape(mdl, name, n, k, copy_gbs, a.sweep)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
