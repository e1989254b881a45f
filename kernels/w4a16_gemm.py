"""W4A16 GEMM / GEMV: bf16 activations [M, K] x NVFP4 weight [N, K] -> bf16 [M, N], dequant fused, fp32 acc.
Without an explicit GemmConfig, M <= 64 runs the GEMV kernels (w4a16_gemv.py) and M > 64 dequantizes to bf16 and
runs one cuBLAS GEMM (w4a16_dequant_matmul).

Even and odd K columns are multiplied separately (x[:, 0::2] with the low nibbles, x[:, 1::2] with the high
ones), so the packed bytes never need interleaving.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .nvfp4_triton import e2m1_times, fp8e4m3_to_f32
from .nvfp4_ref import check_packed, dequantize as _dequantize_ref


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int      # logical K per step; a multiple of 16
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> GemmConfig:
    """Small M is a bandwidth problem: enough (n-tile x k-split) programs to fill every SM twice."""
    if m > 64:
        return GemmConfig(128, 64, 128, num_warps=8)
    if m > 16:
        return GemmConfig(64, 64, 128)
    block_n, block_k = 64, 128
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= steps // 2:
        split *= 2
    return GemmConfig(16, block_n, block_k, split_k=split, num_stages=4)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, packed_ptr, scale_ptr, scale_2_ptr, out_ptr, M, N, K,
                       stride_xm, stride_om, K_PER_SPLIT,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]                 # [BM, 1]
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]                 # [BN, 1]
    pair = tl.arange(0, HALF)[None, :]                                        # [1, BK/2] byte in the step
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        kmask = k0 + 2 * pair < K
        xmask = (rows_m < M) & kmask
        x_even = tl.load(x_ptr + rows_m * stride_xm + k0 + 2 * pair, mask=xmask, other=0.0)     # [BM, BK/2]
        x_odd = tl.load(x_ptr + rows_m * stride_xm + k0 + 2 * pair + 1, mask=xmask, other=0.0)
        wmask = (rows_n < N) & kmask
        b = tl.load(packed_ptr + rows_n * (K // 2) + k0 // 2 + pair, mask=wmask, other=0).to(tl.int32)  # [BN, BK/2]
        s = fp8e4m3_to_f32(tl.load(scale_ptr + rows_n * (K // 16) + (k0 // 2 + pair) // 8, mask=wmask, other=0))
        w_lo = e2m1_times(b & 0xF, s)                                         # [BN, BK/2] code * fp8 scale
        w_hi = e2m1_times(b >> 4, s)
        if DOT_F32:  # the CPU interpreter multiplies bf16 bit patterns in tl.dot: keep operands fp32 there
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_lo))
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_hi))
        else:        # code * fp8 scale has <= 6 significant bits: exact in bf16
            acc += tl.dot(x_even, tl.trans(w_lo.to(tl.bfloat16)))
            acc += tl.dot(x_odd, tl.trans(w_hi.to(tl.bfloat16)))
    acc *= tl.load(scale_2_ptr)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    omask = (rows_m < M) & (cols < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rows_m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.atomic_add(out_ptr + rows_m * stride_om + cols, acc, mask=omask)


def w4a16_gemm(x: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
               config: GemmConfig | None = None, scale_bf16: Tensor | None = None) -> Tensor:
    """x [M, K] bf16 @ dequant(packed [N, K/2], weight_scale [N, K/16], weight_scale_2).T -> [M, N] bf16.

    Runs the Triton kernel; a CPU tensor needs TRITON_INTERPRET=1 (its dot then runs in fp32).
    """
    n, k = check_packed(packed, weight_scale, weight_scale_2)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be a float [M, {k}] tensor, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    from .w4a16_gemv import GEMV_MAX_M, w4a16_gemv
    if config is None and m <= GEMV_MAX_M:  # decode shapes: the memory-bound GEMV (tensor cores from M = 2)
        return w4a16_gemv(x, packed, weight_scale, weight_scale_2, scale_bf16=scale_bf16)
    if config is None:  # M > 64: this kernel measured 14-50x slower than bf16 there (bench/RESULTS.md)
        return w4a16_dequant_matmul(x, packed, weight_scale, weight_scale_2)
    cfg = config or default_config(m, n, k)
    if cfg.split_k > 1 and cfg.block_m > 16:  # measured wrong on an H200 (rel. err 0.86), cause not found yet
        raise ValueError(f"split_k > 1 is only supported with block_m == 16, got {cfg}")
    dot_f32 = not x.is_cuda or x.dtype == torch.float32
    if x.dtype != torch.bfloat16 and not dot_f32:
        x = x.to(torch.bfloat16)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    out = (torch.zeros if split > 1 else torch.empty)(m, n, device=x.device,
                                                       dtype=torch.float32 if split > 1 else torch.bfloat16)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    _w4a16_gemm_kernel[grid](x, packed, weight_scale.view(torch.uint8), weight_scale_2.float().reshape(1), out,
                             m, n, k, x.stride(0), out.stride(0), k_per_split,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
                             DOT_F32=dot_f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(torch.bfloat16) if split > 1 else out


def w4a16_dequant_matmul(x: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> Tensor:
    """M > 16: dequantize to a bf16 temporary (code * fp8 scale, exact in bf16), one bf16 GEMM (fp32 accumulation),
    then weight_scale_2 on the fp32 result: two bf16 roundings instead of one."""
    from . import nvfp4
    unit = torch.ones((), dtype=torch.float32, device=packed.device)
    w = nvfp4.dequantize(packed, weight_scale, unit, torch.bfloat16)                              # [N, K]
    return dense_unit_matmul(x, w, weight_scale_2)


def dense_unit_matmul(x: Tensor, dense_unit: Tensor, weight_scale_2: Tensor) -> Tensor:
    """x [M, K] @ the bf16 temporary [N, K] of w4a16_dequant_matmul (kept by NVFP4Linear.keep_dense) -> bf16."""
    return (F.linear(x.to(torch.bfloat16), dense_unit).float() * weight_scale_2.float()).to(torch.bfloat16)


def w4a16_gemm_ref(x: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
                   config: GemmConfig | None = None) -> Tensor:
    """Reference: dequantize to fp32, matmul in fp32, round once to bf16."""
    w = _dequantize_ref(packed, weight_scale, weight_scale_2, torch.float32)   # [N, K]
    return (x.float() @ w.T).to(torch.bfloat16)
