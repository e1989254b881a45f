"""A batch-invariant matmul for the deterministic mode: y = x @ w^T (+ bias), each output row computed the same way
whatever the other rows are, so a row's result is bit-equal at M = 1 and in a batch of any size.

One tile shape for every M (BLOCK_M x BLOCK_N output tiles, K walked in BLOCK_K steps in order, fp32 accumulation):
a row's dot products see the same operands in the same order and the same tensor-core instruction whichever tile
and batch hold it; other rows only fill the tile's other lanes. cuBLAS and the GEMVs pick their kernels and
reduction splits by M, which is what makes a row's bits depend on its batch. With `k_split` a long K is split by K
alone (pieces of k_split, each walked as above into an fp32 partial, the partials then summed in order by a second
kernel), which gives a decode row's few output tiles more programs; since the split never depends on M, a row's
bits still do not either. `config_for` chooses the split and the tile width of each weight by its shape alone
(KernelConfig's invariant_* fields): bench/bench_matmul_invariant.py times the choices inside CUDA
graphs, where a step runs them.
The reference is F.linear (equal up to rounding): `tests/test_matmul_invariant.py` checks both and the invariance
under the CPU interpreter, `tests/gpu/test_matmul_invariant_gpu.py` on the GPU's tensor cores.

Programs walk the M tiles of one weight tile in a row, so at large M the weight tile is read from L2 after its first
use.
"""

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class InvariantConfig:
    block_m: int = 16   # the rows a program holds (a decode row wastes the rest; every M uses the same tiles)
    block_n: int = 32   # output columns a program holds: small Ns still fill the GPU at one row
    block_k: int = 128
    k_split: int = 0  # > 0: K longer than this is walked in pieces of this many (a multiple of block_k); 0: whole
    num_warps: int = 4
    num_stages: int = 4


CONFIG = InvariantConfig()
MIN_PIECE_STEPS = 2  # a K piece walks at least this many BLOCK_K steps


def config_for(n: int, k: int, min_programs: int, block_n: int = CONFIG.block_n,
               base: InvariantConfig = CONFIG) -> InvariantConfig:
    """The tiles of a weight [n, k], by its shape alone (never by M, so a row's bits stay its own): tiles of block_n
    columns, and K split into equal pieces of whole BLOCK_K steps until one row tile's programs reach min_programs
    (0: K whole), each piece at least MIN_PIECE_STEPS steps."""
    cfg = replace(base, block_n=block_n)
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, cfg.block_k)
    splits = min(triton.cdiv(min_programs, tiles), steps // MIN_PIECE_STEPS) if min_programs > 0 else 1
    return replace(cfg, k_split=triton.cdiv(steps, splits) * cfg.block_k) if splits > 1 else cfg


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, m_tiles, splits, K_SPLIT,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_F32: tl.constexpr, ROW_SUM: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = pid % m_tiles, pid // m_tiles                               # M tiles of one weight tile in a row
    k_start, k_end = 0, K
    if SPLIT:                                                                  # then the K pieces of that tile
        pid_s, pid_n = pid_n % splits, pid_n // splits
        k_start, k_end = pid_s * K_SPLIT, tl.minimum(K, (pid_s + 1) * K_SPLIT)
        y_ptr += pid_s.to(tl.int64) * M * stride_ym                             # its partial [M, N] (fp32)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                               # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                               # [BN]
    rk = tl.arange(0, BLOCK_K)                                                 # [BK]
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)            # [BM, BK]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)            # [BN, BK]
        # The CPU interpreter's tl.dot is numpy's BLAS, whose micro-kernels give a row's bits by its lane in the tile
        # (and its bf16 dot is wrong): there, products and a sum over K in fp32, the same order for every row.
        if ROW_SUM:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, total, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum of the partials [S, M*N] in split order (+ bias), each element alone."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)         # [B] flat (row, column)
    ok = offs < total
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, splits):
        acc += tl.load(p_ptr + s * total + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=256)
def _installed(n: int, k: int, kc) -> InvariantConfig:
    """config_for a weight [n, k] as a KernelConfig's invariant_* fields say."""
    return config_for(n, k, kc.invariant_programs, kc.invariant_block_n,
                      replace(CONFIG, block_k=kc.invariant_block_k, num_warps=kc.invariant_warps))


def matmul_invariant(x: Tensor, w: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype | None = None,
                     config: InvariantConfig | None = None) -> Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N] in out_dtype (default x's), every row as it would be alone.
    config None: config_for the weight's shape as the installed KernelConfig says. A CPU tensor needs
    TRITON_INTERPRET=1."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_invariant takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    if config is None:
        from .config import active
        config = _installed(n, k, active())
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if config.k_split % config.block_k:
        raise ValueError(f"k_split ({config.k_split}) must be a multiple of block_k ({config.block_k})")
    k_split = config.k_split or k
    m_tiles, splits = triton.cdiv(m, config.block_m), triton.cdiv(k, k_split)
    part = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (m_tiles * splits * triton.cdiv(n, config.block_n),)
    _matmul_kernel[grid](x, w, bias if bias is not None and splits == 1 else w, part, m, n, k, x.stride(0),
                         w.stride(0), n, m_tiles, splits, k_split,
                         HAS_BIAS=bias is not None and splits == 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                         BLOCK_K=config.block_k,
                         DOT_F32=x.dtype == torch.float32 or w.dtype == torch.float32, ROW_SUM=not x.is_cuda,
                         SPLIT=splits > 1, num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, bias if bias is not None else part, y, m * n, n,
                                                         splits, HAS_BIAS=bias is not None, BLOCK=block)
    return y
