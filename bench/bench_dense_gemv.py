"""The dense bf16 GEMV (kernels/gemv_bf16.py) against cuBLAS (F.linear) at the target's decode and verify rows, on
the Qwen3-8B and demo-pair (Qwen2.5-0.5B) projection shapes.
Each config is checked against F.linear first; times are CUDA-graph replays over weight copies larger than L2.

    python bench/bench_dense_gemv.py [--sweep] [--mma-sweep] [--ms 1 8 16] [--json out.json]

Each row also times the register-fed mma GEMV (kernels/gemv_bf16_mma.py) and, for gate/up, its SwiGLU epilogue
against cuBLAS + silu_mul.
"""

import argparse
import json

import torch
import torch.nn.functional as F

from bench_nvfp4 import ROTATE_BYTES, copy_bandwidth_gbs, graph_time_us
from dspark_serve.kernels.fused_ops import silu_mul
from dspark_serve.kernels.gemv_bf16 import DenseGemvConfig, default_dense_gemv_config, gemv
from dspark_serve.kernels.gemv_bf16_mma import MmaDenseConfig, default_mma_dense_config, gemv_mma_dense, tile_major

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


def close(got: torch.Tensor, ref: torch.Tensor, of_max: float = 1e-3) -> bool:
    """Within 2**-7 of each value plus of_max of the largest (SwiGLU: one bf16 ulp of gate or up, times the other,
    can exceed 1e-3 of the largest output)."""
    return bool(((got.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs()
                 + of_max * ref.float().abs().max()).all())


def mma_sweep(k: int) -> list[MmaDenseConfig]:
    tiles = ((1, 8, 4, 0), (2, 2, 4, 0), (2, 4, 4, 0), (2, 8, 4, 0), (2, 4, 4, 128), (4, 2, 2, 0), (4, 4, 2, 0),
             (4, 8, 2, 0), (4, 4, 2, 128), (2, 8, 2, 128), (1, 1, 4, 128))              # tiles, warps, vec, l2
    cfgs = [MmaDenseConfig(*t) for t in tiles]
    return [c for c in cfgs if k % (32 * c.vec) == 0]


def _best(results: list) -> tuple:
    return min(results, key=lambda r: r[0])


def bench_shape(model: str, name: str, n: int, k: int, copy_gbs: float, do_sweep: bool, ms: list[int],
                do_mma_sweep: bool) -> list[dict]:
    copies = max(1, min(32, ROTATE_BYTES // (2 * n * k)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    rows = []
    for m in ms:
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
        best_us, best = _best(results)
        mma = []                                                         # the register-fed mma GEMV
        for mc in dict.fromkeys([default_mma_dense_config(m, n, k)] + (mma_sweep(k) if do_mma_sweep else [])):
            if not close(gemv_mma_dense(x, ws[0], config=mc), ref):
                print(f"WRONG mma {model} {name} M={m} {mc}")
                continue
            mma.append((graph_time_us([lambda w=w, mc=mc: gemv_mma_dense(x, w, config=mc) for w in ws]), mc))
        gbs = 2 * n * k / us / 1e3
        row = {"model": model, "shape": name, "N": n, "K": k, "M": m, "us": us, "GBps": gbs,
               "pct_copy": 100 * gbs / copy_gbs, "cublas_us": cublas_us, "speedup_vs_cublas": cublas_us / us,
               "best_us": best_us, "best_config": best.__dict__, "config": cfg.__dict__,
               "all": [(t, c.__dict__) for t, c in results]}
        line = (f"{model:5s} {name:8s} [{n:6d}, {k:5d}] M={m:2d} cuBLAS {cublas_us:7.2f} | gemv {us:7.2f} "
                f"({100 * gbs / copy_gbs:5.1f}%) best {best_us:7.2f}")
        if mma:
            mma_us, mc = mma[0]
            mb_us, mb = _best(mma)
            row.update({"mma_us": mma_us, "mma_pct_copy": 100 * 2 * n * k / mma_us / 1e3 / copy_gbs,
                        "mma_vs_cublas": cublas_us / mma_us, "mma_config": mc.__dict__, "mma_best_us": mb_us,
                        "mma_best_config": mb.__dict__, "mma_all": [(t, c.__dict__) for t, c in mma]})
            line += (f" | mma {mma_us:7.2f} ({row['mma_pct_copy']:5.1f}%, x{cublas_us / mma_us:4.2f} cuBLAS) best "
                     f"{mb_us:7.2f} [{mb.tiles}, {mb.warps}, {mb.vec}, {mb.l2_fetch}]")
            if mc.vec == 4 and n % 16 == 0 and k % 128 == 0:             # the same kernel on tile-major copies
                sw = name == "gate_up"
                tiled = [tile_major(w, swiglu=sw) for w in ws]
                if torch.equal(gemv_mma_dense(x, tiled[0], swiglu=sw), gemv_mma_dense(x, ws[0], swiglu=sw)):
                    row["mma_tiled_us"] = graph_time_us([lambda t=t: gemv_mma_dense(x, t, swiglu=sw) for t in tiled])
                    line += f" | tile-major{' swiglu' if sw else ''} {row['mma_tiled_us']:7.2f}"
                else:
                    print(f"WRONG tile-major {model} {name} M={m}")
                del tiled
        if name == "gate_up" and mma:                                    # SwiGLU epilogue vs cuBLAS + silu_mul
            fused = gemv_mma_dense(x, ws[0], swiglu=True)                # bit for bit silu_mul of its own GEMV
            if torch.equal(fused, silu_mul(gemv_mma_dense(x, ws[0]))) and close(fused, silu_mul(ref), 2 ** -5):
                row["mma_swiglu_us"] = graph_time_us([lambda w=w: gemv_mma_dense(x, w, swiglu=True) for w in ws])
                row["cublas_silu_us"] = graph_time_us([lambda w=w: silu_mul(F.linear(x, w)) for w in ws])
                line += f" | swiglu mma {row['mma_swiglu_us']:7.2f} vs cuBLAS+silu {row['cublas_silu_us']:7.2f}"
            else:
                print(f"WRONG mma swiglu {model} {name} M={m}")
        rows.append(row)
        print(line, flush=True)
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--ms", type=int, nargs="+", default=[1, 8])
    p.add_argument("--mma-sweep", action="store_true", help="sweep the mma GEMV's configs")
    p.add_argument("--json")
    a = p.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write)")
    rows = [r for mdl in a.models for name, (n, k) in SHAPES[mdl].items()
            for r in bench_shape(mdl, name, n, k, copy_gbs, a.sweep, a.ms, a.mma_sweep)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
