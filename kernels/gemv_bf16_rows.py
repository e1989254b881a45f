"""Dense GEMV for 2-8 rows on CUDA cores: x [M, K] @ w [N, K]^T (+ bias) -> [M, N], for weights small enough that a
step is latency-bound (the 0.5B target's verify rows: 1 + 7 tokens). At 8 rows and the Qwen2.5-0.5B shapes the
tensor-core GEMVs (gemv_bf16_mma, the tl.dot path of gemv_bf16) take 2-2.6x a one-row call on qkv and o (H200:
3.4-4.3 us against 1.5-1.6 us, bench/RESULTS.md), most of what an 8-token verify step costs over a plain one there.
This kernel is the one-row kernel's loop with M rows: a program owns BLOCK_N rows of w and walks K in BLOCK_K steps
with one fp32 accumulator [BN, BK] += w * x[m] per row m of x (a tuple of M), reduced once at the end. That is M
times the one-row kernel's FMAs, which small weights leave room for (a [BN, M, BK] broadcast instead measured 2-7x
slower on an H200: layout conversions every step). The first weight tile is loaded before `pdl_wait`. With SWIGLU, w
is [gate; up] [2I, K], a program owns BLOCK_N / 2 gate rows and their up rows, and the epilogue writes silu(gate) *
up with fused_ops.silu_mul's roundings. The reference is gemv_bf16.gemv_ref.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from . import pdl
from .fused_ops import _round
from .pdl import pdl_trigger, pdl_wait

MAX_ROWS = 8
MAX_WEIGHTS = 1 << 24   # N * K below this: latency-bound on an H200 (the 0.5B layers; not its lm_head, not 8B)


@dataclass(frozen=True)
class RowsGemvConfig:
    block_n: int = 16     # weight rows per program (gate + up rows with SWIGLU)
    block_k: int = 64     # K per step; a power of 2 >= 16
    num_warps: int = 4


@triton.jit
def _rows_sum(w0, w_rows, ok, x_ptr, stride_xm, M, K, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
              EVEN_K: tl.constexpr):
    """w0: the first [BN, BK] tile of rows w_rows ([BN, 1] pointers; ok [BN]) -> a tuple of ROWS fp32 [BN]: row m of
    x times w. One [BN, BK] accumulator per row of x, each the one-row kernel's, reduced once at the end."""
    kk = tl.arange(0, BLOCK_K)
    wf = w0.to(tl.float32)
    accs = ()
    for m in tl.static_range(ROWS):
        xm = tl.load(x_ptr + m * stride_xm + kk, mask=(kk < K) & (m < M), other=0.0).to(tl.float32)   # [BK]
        accs = accs + (wf * xm[None, :],)                                                  # [BN, BK] each
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            wmask, xmask = ok[:, None], kk >= 0
        else:
            wmask, xmask = ok[:, None] & (k0 + kk[None, :] < K), k0 + kk < K
        wf = tl.load(w_rows + k0 + kk[None, :], mask=wmask, other=0.0).to(tl.float32)     # [BN, BK]
        new = ()
        for m in tl.static_range(ROWS):
            xm = tl.load(x_ptr + m * stride_xm + k0 + kk, mask=xmask & (m < M), other=0.0).to(tl.float32)
            new = new + (accs[m] + wf * xm[None, :],)
        accs = new
    sums = ()
    for m in tl.static_range(ROWS):
        sums = sums + (tl.sum(accs[m], axis=1),)                                           # [BN]
    return sums


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      EVEN_K: tl.constexpr, PDL: tl.constexpr, SWIGLU: tl.constexpr, OUT_BF16: tl.constexpr,
                      LIBDEVICE: tl.constexpr):
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    if SWIGLU:                                                                         # N = 2I
        BN2: tl.constexpr = BLOCK_N // 2
        inter = N // 2
        cols = pid * BN2 + tl.arange(0, BN2)                                           # [BN2] gate rows
        ok = cols < inter
        g_rows = w_ptr + cols[:, None] * stride_wn
        u_rows = w_ptr + (cols[:, None] + inter) * stride_wn
        m0 = ok[:, None] & (kk[None, :] < K)
        wg = tl.load(g_rows + kk[None, :], mask=m0, other=0.0)                         # the first tiles,
        wu = tl.load(u_rows + kk[None, :], mask=m0, other=0.0)                         # before the wait
        pdl_wait(PDL)
        gs = _rows_sum(wg, g_rows, ok, x_ptr, stride_xm, M, K, BLOCK_K, ROWS, EVEN_K)
        us = _rows_sum(wu, u_rows, ok, x_ptr, stride_xm, M, K, BLOCK_K, ROWS, EVEN_K)
        for m in tl.static_range(ROWS):
            g = gs[m].to(out_ptr.dtype.element_ty).to(tl.float32)                      # the gate_up output's
            u = us[m].to(out_ptr.dtype.element_ty).to(tl.float32)                      # rounding
            if LIBDEVICE:
                e = libdevice.exp(-g)
            else:
                e = tl.exp(-g)
            sg = _round(tl.math.div_rn(g, 1.0 + e), OUT_BF16)                         # as fused_ops._silu_mul_kernel
            tl.store(out_ptr + m * stride_om + cols, _round(sg * u, OUT_BF16).to(out_ptr.dtype.element_ty),
                     mask=ok & (m < M))
    else:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)                                   # [BN]
        ok = rows < N
        w_rows = w_ptr + rows[:, None] * stride_wn
        w0 = tl.load(w_rows + kk[None, :], mask=ok[:, None] & (kk[None, :] < K), other=0.0)
        pdl_wait(PDL)
        outs = _rows_sum(w0, w_rows, ok, x_ptr, stride_xm, M, K, BLOCK_K, ROWS, EVEN_K)
        for m in tl.static_range(ROWS):
            out = outs[m]
            if HAS_BIAS:
                out += tl.load(b_ptr + rows, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + m * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=ok & (m < M))


def rows_ok(x: Tensor, w: Tensor) -> bool:
    """Operands this kernel takes: 2-8 rows of CUDA bf16 x, a bf16 w [N, K] with unit column stride and N * K below
    MAX_WEIGHTS."""
    return (x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS and x.dtype == w.dtype == torch.bfloat16
            and w.dim() == 2 and w.stride(1) == 1 and w.shape[0] * w.shape[1] < MAX_WEIGHTS)


def gemv_rows(x: Tensor, w: Tensor, bias: Tensor | None = None, config: RowsGemvConfig | None = None,
              swiglu: bool = False) -> Tensor:
    """x [M, K] (M <= 8) @ w [N, K]^T (+ bias [N]) -> [M, N] in w's dtype; swiglu (no bias): w is [gate; up] [2I, K]
    and the result silu_mul(x @ w^T) [M, I]. CUDA, or CPU under the Triton interpreter."""
    n, k = w.shape
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or not 1 <= m <= MAX_ROWS or w.stride(1) != 1:
        raise ValueError(f"gemv_rows takes x [1..{MAX_ROWS}, K] and w [N, K] with unit column stride, got x "
                         f"{tuple(x.shape)}, w {tuple(w.shape)} stride {w.stride()}")
    if (bias is not None and (swiglu or bias.shape != (n,))) or (swiglu and n % 2):
        raise ValueError(f"bias must be [{n}] and swiglu needs an even N and no bias, got N = {n}"
                         f"{', a bias' if bias is not None else ''}")
    cfg = config or RowsGemvConfig()
    if cfg.block_k & (cfg.block_k - 1) or cfg.block_k < 16 or cfg.block_n < 2 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"bad RowsGemvConfig {cfg}: block_k a power of 2 >= 16, block_n a power of 2 >= 2")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_out = n // 2 if swiglu else n
    out = torch.empty(m, n_out, device=x.device, dtype=w.dtype)
    if n == 0:
        return out
    on, opts = pdl.launch(x)
    _gemv_rows_kernel[(triton.cdiv(n_out, cfg.block_n // 2 if swiglu else cfg.block_n),)](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS=m,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, PDL=on, SWIGLU=swiglu,
        OUT_BF16=w.dtype == torch.bfloat16, LIBDEVICE=x.is_cuda, num_warps=cfg.num_warps, num_stages=2, **opts)
    return out
