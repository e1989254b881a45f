"""How fast a plain read of each bench_nvfp4 shape's draft weight is: a bound on what a GEMV of that shape can
reach, as good as the read itself.

A GEMV reads its NVFP4 bytes (packed + scales) once per call. Each row times, in a CUDA graph cycling through copies
larger than L2 (as bench_nvfp4 does), a streaming read of exactly those bytes (16-byte loads, several in flight per
thread, an XOR per program stored so nothing is optimised away), the best of a grid of block sizes, and an empty
kernel's launch. It reports the read as % of the copy bandwidth (as bench_nvfp4 reports a GEMV) and bf16 `F.linear`'s
time over it: the `% of copy` and `x vs bf16` a GEMV as fast as that read would reach. It is not a strict floor: at
the 8B target's o projection the one-row bf16 GEMV read its weight 4 % faster (bench/RESULTS.md). Two more reads take
the mma GEMV's access pattern (each program's rows, 64 + 8 bytes of each per 128-K chunk): from the ModelOpt row
layout, and from a tile-major one where a 16-row tile's chunk is one 1 KB piece. --dense adds the target's bf16
projections: each weight's read against the GEMVs the target runs at one row (plain decode) and 8 rows
(verify 1 + 7).
Usage: python bench/bench_read_floor.py [--shapes ...] [--dense] [--json out.json]
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_nvfp4 import ROTATE_BYTES, SHAPES, copy_bandwidth_gbs, graph_time_us

CONFIGS = [(block, iters, warps) for block in (1024, 2048, 4096) for iters in (1, 2, 4, 8) for warps in (4, 8)]


@triton.jit
def _read_kernel(src, out, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in tl.static_range(ITERS):                      # ITERS independent loads in flight per thread
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + tl.program_id(0), tl.reduce(acc, 0, _xor))


@triton.jit
def _rows_kernel(q, sc, out, N, q_words, s_words, CHUNKS_PER_SPLIT, CHUNKS, ROWS: tl.constexpr,
                 TILED: tl.constexpr):
    """The mma GEMV's access pattern without its math: program (n, s) reads ROWS weight rows' 64-byte pieces (16
    words) and 8-byte scale pieces (2 words) of 128-K chunks CHUNKS_PER_SPLIT * s.., one chunk after another.
    TILED: the same bytes in a tile-major layout, [N / 16][chunks][16 rows x 16 words] (and [.][.][16 x 2] for
    scales), where a 16-row tile's chunk is 1 KB in one piece."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rows = tl.minimum(rows, N - 1)
    c_lo = tl.program_id(1) * CHUNKS_PER_SPLIT
    acc = tl.zeros((ROWS, 16), tl.int32)
    acc_s = tl.zeros((ROWS, 2), tl.int32)
    for c in range(c_lo, tl.minimum(c_lo + CHUNKS_PER_SPLIT, CHUNKS)):
        if TILED:
            q_at = ((rows // 16) * CHUNKS + c) * 256 + (rows % 16) * 16
            s_at = ((rows // 16) * CHUNKS + c) * 32 + (rows % 16) * 2
        else:
            q_at = rows * q_words + 16 * c
            s_at = rows * s_words + 2 * c
        acc ^= tl.load(q + q_at[:, None] + tl.arange(0, 16)[None, :])
        acc_s ^= tl.load(sc + s_at[:, None] + tl.arange(0, 2)[None, :])
    v = tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor) ^ tl.reduce(tl.reduce(acc_s, 1, _xor), 0, _xor)
    tl.store(out + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), v)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _empty_kernel(out):
    pass


def read(src: torch.Tensor, out: torch.Tensor, block: int, iters: int, warps: int) -> None:
    n = src.numel()
    _read_kernel[(triton.cdiv(n, block * iters),)](src, out, n, BLOCK=block, ITERS=iters, num_warps=warps)


def read_floor(n_bytes: int) -> tuple[float, tuple]:
    """-> (best us per call, its (block, iters, warps)) reading n_bytes (a multiple of 4) from HBM."""
    words = n_bytes // 4
    copies = [torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32, device="cuda")
              for _ in range(max(2, min(64, ROTATE_BYTES // n_bytes)))]
    out = torch.empty(triton.cdiv(words, 1024), dtype=torch.int32, device="cuda")
    best = (float("inf"), None)
    for cfg in CONFIGS:
        us = graph_time_us([lambda c=c, cfg=cfg: read(c, out, *cfg) for c in copies])
        best = min(best, (us, cfg))
    block, iters, _ = best[1]
    read(copies[0], out, *best[1])                        # the kernel reads what is there: program 0's XOR
    if int(out[0]) != int(_xor_all(copies[0][:block * iters])):
        raise AssertionError("the read kernel's XOR differs from torch's")
    del copies
    torch.cuda.empty_cache()
    return best


def rows_read(n: int, k: int, tiled: bool = False) -> tuple[float, tuple]:
    """-> (best us per call, its (rows per program, split)) reading an NVFP4 [n, k] weight in the mma GEMV's row
    pattern: each program's rows, 64 + 8 bytes of each per 128-K chunk (tiled: from a tile-major layout)."""
    q_words, s_words, chunks = k // 8, k // 64, k // 128
    per = max(2, min(32, ROTATE_BYTES // (n * k * 9 // 16)))
    copies = [(torch.zeros(n, q_words, dtype=torch.int32, device="cuda"),
               torch.zeros(n, s_words, dtype=torch.int32, device="cuda")) for _ in range(per)]
    best = (float("inf"), None)
    for rows in (16, 32, 64, 128):
        for split in (1, 2, 4, 8, 16, 32):
            if chunks % split:
                continue
            grid = (triton.cdiv(n, rows), split)
            out = torch.empty(grid[0] * split, dtype=torch.int32, device="cuda")
            us = graph_time_us([lambda c=c, rows=rows, split=split, out=out, grid=grid: _rows_kernel[grid](
                *c, out, n, q_words, s_words, chunks // split, chunks, ROWS=rows, TILED=tiled, num_warps=4)
                for c in copies])
            best = min(best, (us, (rows, split)))
    del copies
    torch.cuda.empty_cache()
    return best


def _xor_all(t: torch.Tensor) -> torch.Tensor:
    v = t.clone()
    while v.numel() > 1:
        v = v[: v.numel() // 2] ^ v[v.numel() // 2:]
    return v[0]


def bf16_us(n: int, k: int, m: int) -> float:
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
             for _ in range(max(2, min(32, ROTATE_BYTES // (2 * n * k))))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    us = graph_time_us([lambda w=w: F.linear(x, w) for w in dense])
    del dense
    torch.cuda.empty_cache()
    return us


def dense_rows(copy_gbs: float) -> list[dict]:
    """The target's bf16 projections (bench_dense_gemv's shapes): the read floor of each weight against what the
    target runs, `linear` (`linear_silu_mul` for gate/up) at one row (plain decode) and 8 rows (verify 1 + 7)."""
    from bench_dense_gemv import SHAPES as DENSE
    from dspark_serve.kernels.gemv_bf16 import linear, linear_silu_mul
    rows = []
    for model, shapes in DENSE.items():
        for name, (n, k) in shapes.items():
            floor_us, cfg = read_floor(2 * n * k)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                  for _ in range(max(2, min(32, ROTATE_BYTES // (2 * n * k))))]
            fn = linear_silu_mul if name == "gate_up" else linear
            us = {}
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                us[m] = graph_time_us([lambda w=w, x=x: fn(x, w) for w in ws])
            del ws
            torch.cuda.empty_cache()
            rows.append({"model": model, "shape": name, "N": n, "K": k, "bf16_bytes": 2 * n * k, "read_us": floor_us,
                         "read_config": cfg, "read_pct_copy": 100 * 2 * n * k / floor_us / 1e3 / copy_gbs,
                         "linear_us_m1": us[1], "linear_us_m8": us[8]})
            print(f"{model:5s} {name:8s} {2 * n * k / 1e6:8.2f} MB  read {floor_us:7.2f} us = "
                  f"{rows[-1]['read_pct_copy']:5.1f}% of copy  target M=1 {us[1]:7.2f} us "
                  f"({100 * floor_us / us[1]:5.1f}% of the floor's speed)  M=8 {us[8]:7.2f} us "
                  f"({100 * floor_us / us[8]:5.1f}%)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--dense", action="store_true", help="also the target's bf16 projections against their floor")
    p.add_argument("--json", default="bench_read_floor.json")
    args = p.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    out = torch.empty(1, dtype=torch.int32, device="cuda")
    empty_us = graph_time_us([lambda: _empty_kernel[(1,)](out)], reps=200)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write), empty kernel {empty_us:.2f} us "
          "per call in a graph", flush=True)
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        q_bytes = n * k // 2 + n * k // 16                # packed + fp8 scales
        us, cfg = read_floor(q_bytes)
        rows_us, rows_cfg = rows_read(n, k)
        tiled_us, tiled_cfg = rows_read(n, k, tiled=True)
        bf16_1, bf16_8 = bf16_us(n, k, 1), bf16_us(n, k, 8)
        rows.append({"shape": name, "N": n, "K": k, "nvfp4_bytes": q_bytes, "read_us": us, "read_config": cfg,
                     "read_pct_copy": 100 * q_bytes / us / 1e3 / copy_gbs, "rows_read_us": rows_us,
                     "rows_read_config": rows_cfg, "rows_read_pct_copy": 100 * q_bytes / rows_us / 1e3 / copy_gbs,
                     "tiled_read_us": tiled_us, "tiled_read_config": tiled_cfg,
                     "tiled_read_pct_copy": 100 * q_bytes / tiled_us / 1e3 / copy_gbs,
                     "bf16_us_m1": bf16_1, "bf16_us_m8": bf16_8,
                     "max_x_vs_bf16_m1": bf16_1 / us, "max_x_vs_bf16_m8": bf16_8 / us})
        r = rows[-1]
        print(f"{name:8s} {q_bytes / 1e6:7.2f} MB  read {us:7.2f} us = {r['read_pct_copy']:5.1f}% of copy "
              f"{cfg}  row pattern {rows_us:7.2f} us = {r['rows_read_pct_copy']:5.1f}% {rows_cfg}  tiled "
              f"{tiled_us:7.2f} us = {r['tiled_read_pct_copy']:5.1f}% {tiled_cfg}  bf16 M=1 {bf16_1:7.2f} us "
              f"(ceiling x{r['max_x_vs_bf16_m1']:4.2f})  M=8 {bf16_8:7.2f} us "
              f"(x{r['max_x_vs_bf16_m8']:4.2f})", flush=True)
    dense = dense_rows(copy_gbs) if args.dense else []
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": copy_gbs,
                   "empty_kernel_us": empty_us, "rows": rows, "dense": dense}, f, indent=1)


if __name__ == "__main__":
    main()
