"""NVFP4 kernels at Qwen3-8B DSpark draft shapes: GB/s on the NVFP4 bytes vs device copy bandwidth, speedup vs bf16.

Every timing is a CUDA graph of `reps` calls cycling through enough weight copies (> L2) that each call reads
from HBM. Usage: python bench/bench_nvfp4.py [--sweep] [--out results.json]
"""

import argparse
import dataclasses
import json
import math

import torch
import torch.nn.functional as F

from dspark_serve.kernels import nvfp4
from dspark_serve.kernels.w4a16_gemm import (GemmConfig, default_config, w4a16_dequant_matmul, w4a16_gemm,
                                             w4a16_gemm_ref)
from dspark_serve.kernels import config as kernel_config
from dspark_serve.kernels.w4a16_gemv import (GemvConfig, default_gemv_config, mma_config, mma_fits,
                                              tensor_core_config, w4a16_gemv, words_config)

SHAPES = {"fc": (4096, 20480), "q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}
MS = (1, 7, 8, 16, 64, 128)
ROTATE_BYTES = 512 << 20


def graph_time_us(fns, reps: int = 40) -> float:
    """Mean microseconds per call of fns[i % len(fns)], captured in one CUDA graph."""
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def copy_bandwidth_gbs() -> float:
    """Read + write bytes per second of a 1 GiB device-to-device copy_, the faster of eager launches and a CUDA
    graph: a captured copy_ becomes a memcpy node that measured 2.77 TB/s on an H200 where eager copies (SM
    kernels) measured 4.2 TB/s, and the latter is the bandwidth a kernel can reach."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us_graph = graph_time_us([lambda: dst.copy_(src)], reps=10)
    for _ in range(2):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    us_eager = start.elapsed_time(end) * 1e3 / 20
    return 2 * src.numel() / min(us_graph, us_eager) / 1e3  # read + write


def sweep_configs(m: int) -> list[GemmConfig]:
    if m <= 16:
        return [GemmConfig(16, bn, bk, split_k=s, num_warps=w, num_stages=st)
                for bn, bk, w, st in ((32, 256, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (64, 256, 4, 3))
                for s in (1, 4, 8)]
    bm = 64 if m <= 64 else 128
    return [GemmConfig(bm, bn, bk, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4))]


def bench_gemm(name: str, n: int, k: int, copy_gbs: float, sweep: bool) -> list[dict]:
    base = nvfp4.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    q_bytes = base[0].numel() + base[1].numel() + 4
    copies = [tuple(t.clone() for t in base) for _ in range(max(1, min(64, ROTATE_BYTES // q_bytes)))]
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
             for _ in range(max(1, min(32, ROTATE_BYTES // (2 * n * k))))]
    rows = []
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = graph_time_us([lambda w=w: F.linear(x, w) for w in dense])
        configs = [default_config(m, n, k)] + (sweep_configs(m) if sweep else [])
        results = []
        for cfg in dict.fromkeys(configs):
            try:
                us = graph_time_us([lambda c=c, cfg=cfg: w4a16_gemm(x, *c, config=cfg) for c in copies])
            except Exception as exc:  # a config that does not compile / fit: skip it in the sweep
                print(f"skip {cfg}: {type(exc).__name__}")
                continue
            results.append((us, cfg))
        us_default = results[0][0]
        us_best, cfg_best = min(results, key=lambda r: r[0])
        gbs = q_bytes / us_default / 1e3
        rows.append({"shape": name, "N": n, "K": k, "M": m, "nvfp4_bytes": q_bytes, "us": us_default,
                     "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs, "bf16_us": bf16_us,
                     "speedup_vs_bf16": bf16_us / us_default, "best_us": us_best, "best_config": cfg_best.__dict__})
        print(f"{name:8s} M={m:3d} {us_default:8.2f} us {gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}% "
              f"bf16 {bf16_us:8.2f} us x{bf16_us / us_default:4.2f}  best {us_best:8.2f} {cfg_best}", flush=True)
    del copies, dense
    torch.cuda.empty_cache()
    return rows


def gemv_sweep(m: int, n: int, k: int) -> list[GemvConfig]:
    """M == 1: the words kernel (block_n, block_k, warps), each without split-K and with the split that fills 4
    waves. Every M: the tensor-core path with the inline-PTX decode at tiles and stages that trade registers (180
    per thread at [64, 256], 2 programs per SM) for occupancy (bench/sass_loop.py). The byte-tile and integer-decode
    configs of earlier sweeps lost at every shape (bench/RESULTS.md) and are left out."""
    words = []
    if m == 1:
        words = [c for bn, bk, w in ((16, 1024, 4), (8, 1024, 4), (16, 512, 2), (8, 512, 2))
                 for c in (GemvConfig(bn, bk, 1, num_warps=w, words=True), words_config(n, k, bn, bk, w))]
    tiles = ((64, 256, 4, 3), (64, 256, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4),
             (128, 128, 4, 3), (128, 128, 8, 3))
    if m > 16:   # 64 rows of x: [64, 256] weight tiles spill
        tiles = ((64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 2), (128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3))
    prmt = [tensor_core_config(n, k, bn, bk, w, prmt=True, num_stages=st) for bn, bk, w, st in tiles]
    integer = [dataclasses.replace(default_gemv_config(m, n, k), prmt=False)] if m > 1 else []   # integer decode
    mma = [mma_config(n, k, t, w, wps, l2_ahead=ahead, l2_fetch=fetch) for t, w, wps, ahead in (
        (2, 8, 64, 0), (2, 8, 64, 1), (2, 4, 8, 0), (2, 4, 8, 1), (1, 8, 16, 0), (1, 8, 8, 0), (1, 4, 8, 0),
        (1, 8, 4, 0)) for fetch in (0, 128, 256)] if m <= 16 and mma_fits(n, k) else []
    if mma and k % 256 == 0:   # two chunks per loop step
        mma += [mma_config(n, k, t, w, wps, l2_fetch=fetch, unroll=2) for t, w, wps in (
            (2, 8, 64), (2, 4, 8), (1, 8, 16), (1, 8, 8), (1, 4, 8), (1, 8, 4)) for fetch in (0, 128)]
    return words + integer + prmt + mma


def gemv_close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within 1 bf16 ulp of the reference, plus order-of-summation slack."""
    return bool(((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7
                 + 1e-3 * ref.float().abs().max()).all())


def bench_gemv(name: str, n: int, k: int, copy_gbs: float, sweep: bool, ms=(1, 7, 8, 16, 32, 56, 64),
               mma_only: bool = False) -> list[dict]:
    """w4a16_gemv at M in (1, 7, 8, 16): every config checked vs w4a16_gemm_ref, then timed vs bf16 F.linear."""
    base = nvfp4.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    w_bytes = base[0].numel() + base[1].numel() + 4
    copies = [tuple(t.clone() for t in base) for _ in range(max(1, min(64, ROTATE_BYTES // w_bytes)))]
    bf16_scales = [c[1].to(torch.bfloat16) for c in copies]               # what the prmt path reads (kept by a caller)
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
             for _ in range(max(1, min(32, ROTATE_BYTES // (2 * n * k))))]
    rows = []
    for m in ms:                                              # 56: a 7-token draft block for 8 requests
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = w4a16_gemm_ref(x, *base)
        q_bytes = w_bytes + 2 * m * k + 2 * m * n             # packed + scales + activation + output
        bf16_us = graph_time_us([lambda w=w: F.linear(x, w) for w in dense])
        dequant_us = graph_time_us([lambda c=c: w4a16_dequant_matmul(x, *c) for c in copies]) if m > 16 else None
        grid = [c for c in gemv_sweep(m, n, k) if c.mma or not mma_only] if sweep else []
        configs = [default_gemv_config(m, n, k, mma_ok=kernel_config.active().gemv_mma)] + grid
        results, failed = [], []
        for cfg in dict.fromkeys(configs):
            try:
                got = w4a16_gemv(x, *copies[0], config=cfg, scale_bf16=bf16_scales[0])
                if not (gemv_close(got, ref) and gemv_close(w4a16_gemv(x, *base, config=cfg), ref)):
                    failed.append(cfg)
                    print(f"WRONG {cfg}: rel {((got.double() - ref.double()).norm() / ref.double().norm()):.1e}")
                    continue
                us = graph_time_us([lambda c=c, s=s, cfg=cfg: w4a16_gemv(x, *c, config=cfg, scale_bf16=s)
                                    for c, s in zip(copies, bf16_scales)])
            except Exception as exc:
                print(f"skip {cfg}: {type(exc).__name__} {exc}"[:300])
                continue
            results.append((us, cfg))
        us, cfg_default = results[0]
        us_best, cfg_best = min(results, key=lambda r: r[0])
        gbs, gbs_best = q_bytes / us / 1e3, q_bytes / us_best / 1e3
        rows.append({"shape": name, "N": n, "K": k, "M": m, "nvfp4_bytes": q_bytes, "us": us, "GBps": gbs,
                     "pct_copy": 100 * gbs / copy_gbs, "bf16_us": bf16_us, "speedup_vs_bf16": bf16_us / us,
                     "best_us": us_best, "best_GBps": gbs_best, "best_pct_copy": 100 * gbs_best / copy_gbs,
                     "best_speedup_vs_bf16": bf16_us / us_best, "best_config": cfg_best.__dict__,
                     "config": cfg_default.__dict__, "all": [(t, c.__dict__) for t, c in results],
                     "wrong_configs": [c.__dict__ for c in failed], "dequant_matmul_us": dequant_us})
        print(f"{name:8s} [{n}, {k}] M={m:3d} default {us:8.2f} us {gbs:5.0f} GB/s {100 * gbs / copy_gbs:5.1f}% "
              f"x{bf16_us / us:4.2f} | best {us_best:8.2f} us {gbs_best:5.0f} GB/s {100 * gbs_best / copy_gbs:5.1f}% "
              f"x{bf16_us / us_best:4.2f} vs bf16 {bf16_us:7.2f} us"
              + (f" dequant+cuBLAS {dequant_us:7.2f} us" if dequant_us else "") + f"  {cfg_best}", flush=True)
    del copies, dense, bf16_scales
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="also time a grid of GEMM configs per (shape, M)")
    p.add_argument("--mma-only", action="store_true", help="--gemv --sweep: only the mma kernel's configs")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--out", default="bench_nvfp4.json")
    p.add_argument("--gemv", action="store_true", help="only the GEMV path (w4a16_gemv), M in --ms")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 7, 8, 16, 32, 56, 64], help="--gemv: rows of x")
    args = p.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}  device-to-device copy {copy_gbs:.0f} GB/s (read + write bytes)", flush=True)
    if args.gemv:
        rows = [r for s in args.shapes for r in bench_gemv(s, *SHAPES[s], copy_gbs, args.sweep, args.ms, args.mma_only)]
        print("shape, M: default us, % of copy, x vs bf16 | best us, x vs bf16, [block_n, block_k, warps, stages] "
              "prmt/words | M > 16: dequant+cuBLAS us")
        for r in rows:
            c = r["best_config"]
            kind = "words" if c["words"] else "prmt" if c["prmt"] else "int"
            if c.get("mma"):
                kind = (f"mma split {c['split_k']} l2 {c['l2_fetch']}" + (f" ahead {c['l2_ahead']}" if c["l2_ahead"]
                        else "") + (f" unroll {c['unroll']}" if c.get("unroll", 1) > 1 else ""))
            deq = f" | {r['dequant_matmul_us']:7.2f}" if r["dequant_matmul_us"] else ""
            print(f"  {r['shape']:8s} M={r['M']:2d} {r['us']:8.2f} {r['pct_copy']:5.1f}% "
                  f"x{r['speedup_vs_bf16']:4.2f} | "
                  f"{r['best_us']:8.2f} x{r['best_speedup_vs_bf16']:4.2f} "
                  f"[{c['block_n']}, {c['block_k']}, {c['num_warps']}, {c['num_stages']}] {kind}{deq}")
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs, "copy_convention":
                       "2 * bytes / time (read + write), 1 GiB uint8 copy_, faster of eager and graph", "gemv": rows,
                       "torch": torch.__version__}, f, indent=1)
        return
    rows = [r for s in args.shapes for r in bench_gemm(s, *SHAPES[s], copy_gbs, args.sweep)]
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs, "gemm": rows,
                   "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
