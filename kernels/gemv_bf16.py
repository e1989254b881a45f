"""Dense GEMV for decode rows (M <= 16; the target's layers use it at one row, `linear`): x [M, K] @ w [N, K]^T
(+ bias) -> [M, N], bf16 weights, fp32 accumulation, one output rounding.

At batch 1 cuBLAS picks 64-row tiles without split-K for the 8B's qkv projection ([6144, 4096]: 96 CTAs on 132
SMs) and split-K plus a reduce kernel for o and down (bench/RESULTS.md, the 8B step). Here every program owns
BLOCK_N rows and walks all of K, so N / BLOCK_N programs fill the SMs without split-K and nothing follows the kernel.

* M == 1: CUDA cores. acc [BN, BK] += w * x over K tiles, one reduction at the end. With SWIGLU, w is the fused
  [gate; up] weight [2I, K] and a program owns BN/2 gate rows and their BN/2 up rows; the epilogue writes
  silu(gate) * up [1, I] with fused_ops.silu_mul's roundings, so the MLP needs no silu_mul launch and the bytes
  equal the unfused pair's (`linear_silu_mul`).
* 1 < M <= 16: tensor cores with swapped operands, out^T [BN, BM] += w [BN, BK] @ x^T [BK, BM] (x padded by masking).

The reference is `gemv_ref` (F.linear on the same operands). A CPU tensor needs TRITON_INTERPRET=1; there the
tensor-core path's dot runs in fp32 (the interpreter's bf16 dot is wrong).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from . import pdl
from .config import active
from .fused_ops import _round, _rsqrt, rms_norm, silu_mul
from .gemv_bf16_mma import gemv_mma_dense, mma_dense_ok
from .pdl import pdl_trigger, pdl_wait


Norm = tuple[Tensor, float, "Tensor | None"]  # an RMSNorm before the GEMV: weight [K], eps, residual [1, K] or None
MAX_NORM_K = 16384  # a fused norm holds x's whole row in registers


@dataclass(frozen=True)
class DenseGemvConfig:
    block_n: int
    block_k: int          # a power of 2
    num_warps: int = 4
    num_stages: int = 3


def default_dense_gemv_config(m: int, n: int, k: int) -> DenseGemvConfig:
    """From the H200 sweep (bench/bench_dense_gemv.py --sweep, bench/RESULTS.md) at M = 1: 16-row tiles; the
    longest K steps with 8 warps for long K or few rows, the shortest for vocab- and MLP-wide N. M > 1 (tensor
    cores): [64, 128] tiles, the best at M = 8 on most shapes (cuBLAS was faster on qkv, o and down there)."""
    if m > 1:
        return DenseGemvConfig(64, 128, num_warps=4, num_stages=4)
    if k >= 8192 or n <= 4096:
        return DenseGemvConfig(16, 1024, num_warps=8)
    return DenseGemvConfig(16, 256 if n >= 9728 else 512, num_warps=4)


@triton.jit
def _x_chunk(x_ptr, res_ptr, nw_ptr, k, mask, rstd, NORM: tl.constexpr, HAS_RES: tl.constexpr,
             X_BF16: tl.constexpr):
    """x[k] as fp32; with NORM, RMSNorm(x [+ residual])[k] with fused_ops.rms_norm's roundings (rstd given)."""
    xv = tl.load(x_ptr + k, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        if HAS_RES:
            xv = _round(xv + tl.load(res_ptr + k, mask=mask, other=0.0).to(tl.float32), X_BF16)
        xv = _round(xv * rstd, X_BF16)
        xv = _round(tl.load(nw_ptr + k, mask=mask, other=0.0).to(tl.float32) * xv, X_BF16)  # out dtype: x's
    return xv


@triton.jit
def _norm_prologue(x_ptr, res_ptr, res_out_ptr, K, inv_k, eps, pid, K_ROW: tl.constexpr, HAS_RES: tl.constexpr,
                   X_BF16: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The row's 1 / rms of x [+ residual] (fused_ops.rms_norm's); program 0 writes x + residual to res_out."""
    kr = tl.arange(0, K_ROW)
    s = tl.load(x_ptr + kr, mask=kr < K, other=0.0).to(tl.float32)                                 # [K_ROW]
    if HAS_RES:
        s = _round(s + tl.load(res_ptr + kr, mask=kr < K, other=0.0).to(tl.float32), X_BF16)
        tl.store(res_out_ptr + kr, s.to(res_out_ptr.dtype.element_ty), mask=(kr < K) & (pid == 0))
    return _rsqrt(tl.sum(s * s, axis=0) * inv_k + eps, LIBDEVICE)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 res_ptr, nw_ptr, res_out_ptr, inv_k, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
                 DOT_F32: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                 SWIGLU: tl.constexpr, OUT_BF16: tl.constexpr, LIBDEVICE: tl.constexpr,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr, K_ROW: tl.constexpr, X_BF16: tl.constexpr):
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)                               # [BN]
    kk = tl.arange(0, BLOCK_K)                                                 # [BK]
    if USE_DOT:
        ms = tl.arange(0, BLOCK_M)                                             # [BM]
        m0 = (rows[:, None] < N) & (kk[None, :] < K)                           # the first tile, before the wait
        w = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :], mask=m0, other=0.0)              # [BN, BK]
        pdl_wait(PDL)
        xt = tl.load(x_ptr + ms[None, :] * stride_xm + kk[:, None], mask=(ms[None, :] < M) & (kk[:, None] < K),
                     other=0.0)                                                # [BK, BM]
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc = tl.dot(w, xt.to(w.dtype))
        for k0 in range(BLOCK_K, K, BLOCK_K):
            if EVEN_K:
                wmask, xmask = rows[:, None] < N, ms[None, :] < M
            else:
                wmask = (rows[:, None] < N) & (k0 + kk[None, :] < K)
                xmask = (ms[None, :] < M) & (k0 + kk[:, None] < K)
            w = tl.load(w_ptr + rows[:, None] * stride_wn + k0 + kk[None, :], mask=wmask, other=0.0)   # [BN, BK]
            xt = tl.load(x_ptr + ms[None, :] * stride_xm + k0 + kk[:, None], mask=xmask, other=0.0)   # [BK, BM]
            if DOT_F32:
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
            else:
                acc += tl.dot(w, xt.to(w.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + ms[None, :] * stride_om + rows[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < N) & (ms[None, :] < M))
    elif SWIGLU:                                                               # N = 2I; programs own I / BN2 cols
        BN2: tl.constexpr = BLOCK_N // 2
        cols = pid * BN2 + tl.arange(0, BN2)                                   # [BN2] gate rows; + I: up rows
        inter = N // 2
        m0 = (cols[:, None] < inter) & (kk[None, :] < K)                       # the first tile, before the wait
        wg = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=m0, other=0.0)           # [BN2, BK]
        wu = tl.load(w_ptr + (cols[:, None] + inter) * stride_wn + kk[None, :], mask=m0, other=0.0)
        pdl_wait(PDL)
        rstd = 1.0
        if NORM:
            rstd = _norm_prologue(x_ptr, res_ptr, res_out_ptr, K, inv_k, eps, pid, K_ROW, HAS_RES, X_BF16,
                                  LIBDEVICE)
        xv = _x_chunk(x_ptr, res_ptr, nw_ptr, kk, kk < K, rstd, NORM, HAS_RES, X_BF16)                 # [BK]
        acc_g = wg.to(tl.float32) * xv[None, :]
        acc_u = wu.to(tl.float32) * xv[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            if EVEN_K:
                wmask, xmask = cols[:, None] < inter, kk >= 0
            else:
                wmask, xmask = (cols[:, None] < inter) & (k0 + kk[None, :] < K), k0 + kk < K
            wg = tl.load(w_ptr + cols[:, None] * stride_wn + k0 + kk[None, :], mask=wmask, other=0.0)  # [BN2, BK]
            wu = tl.load(w_ptr + (cols[:, None] + inter) * stride_wn + k0 + kk[None, :], mask=wmask, other=0.0)
            xv = _x_chunk(x_ptr, res_ptr, nw_ptr, k0 + kk, xmask, rstd, NORM, HAS_RES, X_BF16)
            acc_g += wg.to(tl.float32) * xv[None, :]
            acc_u += wu.to(tl.float32) * xv[None, :]
        g = tl.sum(acc_g, axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)  # the gate_up output's rounding
        u = tl.sum(acc_u, axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        sg = _round(tl.math.div_rn(g, 1.0 + e), OUT_BF16)                     # as fused_ops._silu_mul_kernel
        tl.store(out_ptr + cols, _round(sg * u, OUT_BF16).to(out_ptr.dtype.element_ty), mask=cols < inter)
    else:
        m0 = (rows[:, None] < N) & (kk[None, :] < K)                           # the first tile, before the wait
        w = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :], mask=m0, other=0.0)              # [BN, BK]
        pdl_wait(PDL)
        rstd = 1.0
        if NORM:
            rstd = _norm_prologue(x_ptr, res_ptr, res_out_ptr, K, inv_k, eps, pid, K_ROW, HAS_RES, X_BF16,
                                  LIBDEVICE)
        xv = _x_chunk(x_ptr, res_ptr, nw_ptr, kk, kk < K, rstd, NORM, HAS_RES, X_BF16)                 # [BK]
        acc = w.to(tl.float32) * xv[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            if EVEN_K:
                wmask, xmask = rows[:, None] < N, kk >= 0
            else:
                wmask, xmask = (rows[:, None] < N) & (k0 + kk[None, :] < K), k0 + kk < K
            w = tl.load(w_ptr + rows[:, None] * stride_wn + k0 + kk[None, :], mask=wmask, other=0.0)   # [BN, BK]
            xv = _x_chunk(x_ptr, res_ptr, nw_ptr, k0 + kk, xmask, rstd, NORM, HAS_RES, X_BF16)
            acc += w.to(tl.float32) * xv[None, :]
        out = tl.sum(acc, axis=1)                                              # [BN]
        if HAS_BIAS:
            out += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: Tensor, w: Tensor, bias: Tensor | None = None, config: DenseGemvConfig | None = None,
         swiglu: bool = False, norm: Norm | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N] in w's dtype; M <= 16. swiglu (M = 1, no bias): w is
    [gate; up] [2I, K] and the result silu_mul(x @ w^T) [1, I]. norm (M = 1, K <= MAX_NORM_K): x is the input of
    an RMSNorm that the kernel applies first (fused_ops.rms_norm's values) -> (the result, the new residual)."""
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"w must be [N, K] with unit column stride, got {tuple(w.shape)}")
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be a float [M, {k}] tensor, got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if m > 16:
        raise ValueError(f"gemv handles M <= 16, got M = {m}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if swiglu and (m != 1 or bias is not None or n % 2 or w.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError(f"swiglu needs one row, no bias, an even N and bf16/fp32 w, got M = {m}, N = {n}, "
                         f"{w.dtype}{', a bias' if bias is not None else ''}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if norm is not None:
        _check_norm(x, norm)
    cfg = config or default_dense_gemv_config(m, n, k)
    if cfg.block_k & (cfg.block_k - 1) or cfg.block_k < 16 or (m > 1 and cfg.block_n < 16) \
            or (swiglu and (cfg.block_n < 2 or cfg.block_n & (cfg.block_n - 1))):
        raise ValueError(f"bad DenseGemvConfig {cfg}: block_k a power of 2 >= 16, block_n >= 16 for M > 1, "
                         "a power of 2 >= 2 for swiglu")
    n_out = n // 2 if swiglu else n
    out = torch.empty(m, n_out, device=x.device, dtype=w.dtype)
    nw, eps, res = norm if norm is not None else (w, 0.0, None)
    res_out = torch.empty_like(x) if res is not None else x  # without a residual, x is the residual
    if m == 0 or n == 0:
        return out if norm is None else (out, res_out)
    on, opts = pdl.launch(x)
    _gemv_kernel[(triton.cdiv(n_out, cfg.block_n // 2 if swiglu else cfg.block_n),)](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        res if res is not None else x, nw, res_out, 1.0 / k, eps,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=max(16, triton.next_power_of_2(m)), USE_DOT=m > 1,
        DOT_F32=not x.is_cuda or w.dtype == torch.float32, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        PDL=on, SWIGLU=swiglu, OUT_BF16=w.dtype == torch.bfloat16, LIBDEVICE=x.is_cuda,
        NORM=norm is not None, HAS_RES=res is not None, K_ROW=triton.next_power_of_2(k),
        X_BF16=x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts)
    return out if norm is None else (out, res_out)


def _check_norm(x: Tensor, norm: Norm) -> None:
    nw, _, res = norm
    m, k = x.shape
    if m != 1 or k > MAX_NORM_K:
        raise ValueError(f"a fused RMSNorm needs one row of K <= {MAX_NORM_K}, got [{m}, {k}]")
    if nw.shape != (k,) or nw.stride(0) != 1:
        raise ValueError(f"the norm weight must be a contiguous [{k}], got {tuple(nw.shape)}")
    if torch.promote_types(nw.dtype, x.dtype) != x.dtype:
        raise ValueError(f"the norm's output dtype must be x's ({x.dtype}), got weight {nw.dtype}")
    if res is not None and (res.shape != x.shape or res.dtype != x.dtype or res.stride(1) != 1):
        raise ValueError(f"the residual must be a unit-column-stride {x.dtype} {tuple(x.shape)} tensor")


def gemv_ref(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same in PyTorch: F.linear."""
    return F.linear(x.to(w.dtype), w, bias)


def _mma_rows(x: Tensor, w: Tensor) -> bool:
    cfg = active()
    return cfg.dense_gemv and cfg.dense_mma and x.shape[0] >= 2 and mma_dense_ok(x, w)  # (which takes M <= 16)


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None, tiled: Tensor | None = None) -> Tensor:
    """F.linear for the target's fused decoder layers: one row (plain decode at batch 1) of bf16 CUDA activations
    takes `gemv` (KernelConfig.dense_gemv); 2 to 16 rows the register-fed mma GEMV (verify's 1 + 7 rows;
    KernelConfig.dense_mma), on `tiled` (w's tile-major copy, gemv_bf16_mma.tile_major) where the layer keeps one."""
    if _mma_rows(x, w):
        return gemv_mma_dense(x, tiled if tiled is not None else w, bias)
    if _one_row_gemv(x, w):
        return gemv(x, w, bias)
    return F.linear(x, w, bias)


def linear_silu_mul(x: Tensor, w_gate_up: Tensor, tiled: Tensor | None = None) -> Tensor:
    """silu_mul(F.linear(x, w_gate_up)) for the fused MLP: x [T, K], w_gate_up [2I, K] -> [T, I]. One row of bf16
    CUDA activations takes the GEMV with the SwiGLU epilogue (one launch, same values) under
    KernelConfig.gemv_swiglu; the rows of the mma GEMV (`linear`) take its SwiGLU epilogue."""
    swiglu = active().gemv_swiglu
    if swiglu and _mma_rows(x, w_gate_up):
        return gemv_mma_dense(x, tiled if tiled is not None else w_gate_up, swiglu=True)
    if swiglu and x.shape[0] == 1 and _one_row_gemv(x, w_gate_up):
        return gemv(x, w_gate_up, swiglu=True)
    return silu_mul(linear(x, w_gate_up))


def _one_row_gemv(x: Tensor, w: Tensor) -> bool:
    """Whether `linear` takes `gemv` for these operands (one row of bf16 CUDA activations, KernelConfig.dense_gemv)."""
    return (active().dense_gemv and x.is_cuda and x.shape[0] == 1
            and x.dtype == w.dtype == torch.bfloat16 and w.stride(1) == 1)


def apply_norm(x: Tensor, norm: Norm) -> tuple[Tensor, Tensor]:
    """fused_ops.rms_norm of x (+ the residual) -> (normed, the new residual: x + residual, or x)."""
    nw, eps, res = norm
    return (rms_norm(x, nw, eps), x) if res is None else rms_norm(x, nw, eps, res)


def _fuse_norm(x: Tensor, w: Tensor, norm: Norm) -> bool:
    """Whether `gemv` applies the norm: one row that `linear` gives it, a norm weight of x's dtype."""
    return active().norm_gemv and x.shape[0] == 1 and x.shape[1] <= MAX_NORM_K and norm[0].dtype == x.dtype \
        and not _mma_rows(x, w) and _one_row_gemv(x, w)


def norm_linear(x: Tensor, norm: Norm, w: Tensor, bias: Tensor | None = None,
                tiled: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """linear(RMSNorm(x [+ residual]), w, bias, tiled) and the new residual; the one-row GEMV applies the norm
    itself (KernelConfig.norm_gemv), other rows run fused_ops.rms_norm first."""
    if _fuse_norm(x, w, norm):
        return gemv(x, w, bias, norm=norm)
    h, residual = apply_norm(x, norm)
    return linear(h, w, bias, tiled), residual


def norm_linear_silu_mul(x: Tensor, norm: Norm, w_gate_up: Tensor,
                         tiled: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """linear_silu_mul(RMSNorm(x [+ residual]), ...) and the new residual, as norm_linear."""
    if active().gemv_swiglu and _fuse_norm(x, w_gate_up, norm):
        return gemv(x, w_gate_up, swiglu=True, norm=norm)
    h, residual = apply_norm(x, norm)
    return linear_silu_mul(h, w_gate_up, tiled), residual
