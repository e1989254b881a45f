"""W4A16 GEMV for decode shapes (M <= 64): bf16 x [M, K] @ NVFP4 weight [N, K]^T -> bf16 [M, N].

Memory-bound design: each program owns BLOCK_N weight rows and walks K in BLOCK_K steps, loading the packed bytes
as [BLOCK_N, BLOCK_K/2] tiles contiguous along K and the fp8 scales once per 16 elements. E2M1 is decoded with
integer ops into fp32 bits (no table, no cvt). Two reductions:

* M == 1 (``use_dot=False``): the unscaled codes times x are summed per 16-group (tl.sum), the group sums are then
  scaled by the fp8 scale, so the scale costs one multiply per 16 weights.
* 1 < M <= 64 (``use_dot=True``): swapped operands, out^T [BLOCK_N, BM] += W_tile [BLOCK_N, BK/2] @ x^T [BK/2, BM]
  on tensor cores, BM = 16, 32 or 64 (x rows padded by masking), so the weight is read and decoded once for up to
  64 rows (a 7-token draft block for up to 9 requests); the decoded weight (code * fp8 scale, <= 6 significant
  bits) is exact in bf16. Under the CPU interpreter the dot runs in fp32 (its bf16 dot is wrong there). With
  ``GemvConfig(prmt=True)`` (CUDA) the decode is the inline PTX of `e2m1_prmt` (byte tables, bf16 scales).

Even and odd K columns are handled separately (low / high nibble), so the packed bytes are never interleaved.
weight_scale_2 is applied once at the end. Split-K (fp32 atomics + cast) only when there are too few N tiles.
``GemvConfig(words=True)`` runs the int32-word CUDA-core kernel of `w4a16_gemv_words` instead, for any M <= 16, and
``GemvConfig(mma=True)`` the register-fed tensor-core kernel of `w4a16_gemv_mma` (sm_90, M <= 16; the default there
for bf16 x where K % 128 == 0 and N % 16 == 0; x in another dtype is rounded to bf16 for it).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import active
from .e2m1_prmt import e2m1_scaled_bf16
from .nvfp4_triton import fp8e4m3_to_f32
from .nvfp4_ref import check_packed
from .w4a16_gemv_mma import CHUNK_K, gemv_mma
from .w4a16_gemv_words import gemv_words


GEMV_MAX_M = 64   # rows of x one tensor-core program covers; above, w4a16_gemm dequantizes once for cuBLAS


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int          # logical K per step; a power of 2, >= 32
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 3
    join: bool = True     # M == 1 path: x loaded contiguous, codes interleaved with tl.join (else [BN, G, 8] tiles)
    words: bool = False   # the int32-word CUDA-core kernel (w4a16_gemv_words.py) for any M <= 16; use_dot, join unused
    prmt: bool = False    # tensor-core path on CUDA: decode with the inline-PTX byte tables of e2m1_prmt.py
    mma: bool = False     # register-fed mma.sync kernel of w4a16_gemv_mma.py (sm_90, M <= 16); block_n = 16 rows x
                          # tiles per warp x num_warps, block_k unused
    l2_ahead: int = 0     # mma kernel: prefetch the weights this many 128-K chunks ahead into L2 (0: off)
    l2_fetch: int = 0     # mma kernel: weight loads ask L2 for 128 or 256 bytes (the L2::128B / 256B hint; 0: none)
    unroll: int = 1       # mma kernel: 128-K chunks per loop step, all loaded a step ahead (1 or 2; 2: K % 256 == 0)
    l1_hints: bool = False  # mma kernel: weight loads L1::no_allocate, x loads L1::evict_last


def default_gemv_config(m: int, n: int, k: int, num_sms: int = 132, mma_ok: bool = False) -> GemvConfig:
    """From H200 sweeps (bench/bench_nvfp4.py --gemv --sweep, bench/RESULTS.md): M == 1 takes the int32-word
    kernel with [8, 512] tiles and 2 warps (1.37-1.69x bf16 on five of the six 8B draft shapes); M > 1 the
    tensor-core path with the inline-PTX decode (KernelConfig.gemv_prmt): [64, 256] tiles up to M = 16 (within 5 % of
    the best config of the 2026-12-01 sweep at every shape, 0.88-1.48x bf16, where the integer decode measured
    0.51-0.75x); above 16 rows the sweep's best, one for long K or a vocab-sized N (fc, down, lm_head), one for
    the rest. With mma_ok (an sm_90 device and KernelConfig.gemv_mma), M <= 16 takes the register-fed mma kernel where
    its shapes allow (K % 128 == 0, N % 16 == 0): 1.0-1.5x the kernels above at the 8B draft shapes (one sweep);
    two chunks per loop step (unroll) for lm_head at one row and fc, gate/up, down at 2-8 rows (3.6-7.5 % faster
    in the unroll sweep)."""
    if mma_ok and m <= 16 and mma_fits(n, k):   # the 2026-12-01 sweeps' best: 8-warp programs up to 8 rows of x;
        unroll = 2 if k % 256 == 0 else 1       # two 128-K chunks per loop step where they measured faster
        if n >= 65536:                          # a vocab-sized N with the L2::128B hint on its weight loads
            if m == 1:                          # and the L1 hints (8B lm_head: 96.5-99.6 instead of 104 us)
                return mma_config(n, k, 1, 4, 8, num_sms, l2_fetch=128, unroll=unroll, l1_hints=True)
            return mma_config(n, k, 2, 8 if m <= 8 else 4, 64 if m <= 8 else 8, num_sms, l2_fetch=128)
        if 1 < m <= 8 and n * k >= 1 << 25 and unroll == 2:   # fc, gate/up, down (q/o, k/v: 15 % slower)
            return mma_config(n, k, 2, 4, 8, num_sms, l2_fetch=128, unroll=2)
        return mma_config(n, k, 1, 8, 16, num_sms) if m <= 8 else mma_config(n, k, 2, 4, 8, num_sms)
    if m == 1:
        return words_config(n, k, 8, 512, 2, num_sms)
    if m > 16:   # [64, 256] weight tiles spill with 32-64 rows of x; long K or a vocab-sized N take wider tiles
        big = k >= 8192 or n >= 65536
        if m > 32 and big:
            return tensor_core_config(n, k, 128, 64, prmt=active().gemv_prmt, num_stages=4)
        if big:
            return tensor_core_config(n, k, 128, 128, 8, prmt=active().gemv_prmt)
        return tensor_core_config(n, k, 64, 128, prmt=active().gemv_prmt)
    return tensor_core_config(n, k, prmt=active().gemv_prmt)


def tensor_core_config(n: int, k: int, block_n: int = 64, block_k: int = 256, num_warps: int = 4,
                       prmt: bool = False, programs: int = 240, num_stages: int = 3) -> GemvConfig:
    """A tensor-core config, split-K (a power of 2) only while the N tiles alone give fewer than `programs`."""
    tiles, steps, split = triton.cdiv(n, block_n), triton.cdiv(k, block_k), 1
    while tiles * split < programs and split * 2 <= steps:
        split *= 2
    return GemvConfig(block_n, block_k, split, True, num_warps=num_warps, num_stages=num_stages, join=False, prmt=prmt)


def mma_fits(n: int, k: int) -> bool:
    return k % CHUNK_K.value == 0 and n % 16 == 0 and k > 0 and n > 0


def mma_config(n: int, k: int, tiles: int = 2, num_warps: int = 4, warps_per_sm: int = 8, num_sms: int = 132,
               l2_ahead: int = 0, l2_fetch: int = 0, unroll: int = 1, l1_hints: bool = False) -> GemvConfig:
    """An mma-kernel config (tiles of 16 rows per warp) whose split-K (a power of 2, at least one step of `unroll`
    128-K chunks per split) gives at least `warps_per_sm` warps per SM."""
    warps, steps, split = triton.cdiv(n, 16 * tiles), k // CHUNK_K.value // unroll, 1
    while warps * split < warps_per_sm * num_sms and split * 2 <= steps:
        split *= 2
    return GemvConfig(16 * tiles * num_warps, CHUNK_K.value, split, num_warps=num_warps, mma=True, l2_ahead=l2_ahead,
                      l2_fetch=l2_fetch, unroll=unroll, l1_hints=l1_hints)


def stacked_gemv(x: Tensor, packed: Tensor, weight_scale: Tensor, row_scale: Tensor) -> Tensor | None:
    """x [M, K] @ layers stacked along N (packed [N, K/2], weight_scale [N, K/16], row_scale [N] fp32: each row's
    layer's weight_scale_2) -> bf16 [M, N] on the mma kernel, or None where it does not take them (M outside 2..16,
    not bf16 on sm_90, KernelConfig.gemv_mma / nvfp4_stack off, or the shape): the caller runs the layers then."""
    (m, k), n = x.shape, packed.shape[0]
    if not (2 <= m <= 16 and active().gemv_mma and active().nvfp4_stack and x.dtype == torch.bfloat16
            and x.is_cuda and mma_fits(n, k) and _has_bf16x2_mul(x.device)):
        return None
    cfg = default_gemv_config(m, n, k, mma_ok=True)
    return _run_mma(x, packed, weight_scale, row_scale, cfg) if cfg.mma else None


def _run_mma(x: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, cfg: GemvConfig) -> Tensor:
    return gemv_mma(x.to(torch.bfloat16), packed, weight_scale, weight_scale_2, cfg.block_n // (16 * cfg.num_warps),
                    cfg.num_warps, cfg.split_k, cfg.l2_ahead, cfg.l2_fetch, cfg.unroll, cfg.l1_hints)


def words_config(n: int, k: int, block_n: int, block_k: int, num_warps: int, num_sms: int = 132,
                 waves: int = 4) -> GemvConfig:
    """A words-kernel config whose split-K (a power of 2, at most one block_k step per split) gives at least
    `waves` programs per SM."""
    tiles, steps, split = triton.cdiv(n, block_n), triton.cdiv(k, block_k), 1
    while tiles * split < waves * num_sms and split * 2 <= steps:
        split *= 2
    return GemvConfig(block_n, block_k, split, num_warps=num_warps, words=True)


@triton.jit
def e2m1_value(code):
    """4-bit E2M1 codes (int32) -> exact fp32 values with integer ops; only the low 4 bits of `code` are read.

    (mag << 22) + (126 << 23) puts E under fp32's exponent (bias 127 - 1) and M under its top mantissa bit: exact for
    E > 0; for E == 0 it reads 0.5 + M / 4, mapped to M / 2 by 2 f - 1.
    """
    mag = code & 7
    f = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    f = tl.where(mag < 2, 2.0 * f - 1.0, f)
    return (f.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _store_row(acc, scale_2_ptr, out_ptr, pid_n, N, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc [BN] fp32 (one output row, M = 1) times weight_scale_2, stored, or added when K is split."""
    acc *= tl.load(scale_2_ptr)
    n1 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:
        tl.store(out_ptr + n1, acc.to(out_ptr.dtype.element_ty), mask=n1 < N)
    else:
        tl.atomic_add(out_ptr + n1, acc, mask=n1 < N)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, packed_ptr, scale_ptr, scale_bf16_ptr, scale_2_ptr, out_ptr, M, N, K, stride_xm,
                       stride_om, K_PER_SPLIT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, JOIN: tl.constexpr, PRMT: tl.constexpr,
                       EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if USE_DOT:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]                # [BN, 1]
        pair = tl.arange(0, HALF)[None, :]                                     # [1, BK/2]
        grp = tl.arange(0, G)[None, :]                                         # [1, G]
        kk = tl.arange(0, BLOCK_K)[None, :]                                    # [1, BK]
        mm = tl.arange(0, BLOCK_M)[:, None]                                    # [BM, 1]
        ms = tl.arange(0, BLOCK_M)[None, :]                                    # [1, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:                                                         # no K masks: vector loads
                bmask, smask, xmask = rows < N, rows < N, mm < M
            else:
                bmask = (rows < N) & (k0 + 2 * pair < k_hi)
                smask = (rows < N) & (k0 + 16 * grp < k_hi)
                xmask = (mm < M) & (k0 + kk < k_hi)
            b = tl.load(packed_ptr + rows * (K // 2) + k0 // 2 + pair, mask=bmask, other=0)          # [BN, BK/2]
            if PRMT:                                                           # bf16 code * scale, exact
                if EVEN_K:
                    g2 = tl.arange(0, G // 2)[None, :]
                    s32 = tl.load(scale_bf16_ptr.to(tl.pointer_type(tl.int32)) + rows * (K // 32) + k0 // 32 + g2,
                                  mask=rows < N, other=0)    # [BN, G/2] bf16 pairs: 4 bytes, so cp.async pipelines it
                    s = tl.reshape(tl.join(s32 & 0xFFFF, s32 >> 16), (BLOCK_N, G))
                    s = s.to(tl.int16).to(tl.bfloat16, bitcast=True)
                else:
                    s = tl.load(scale_bf16_ptr + rows * (K // 16) + k0 // 16 + grp, mask=smask, other=0.0)
                s8 = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, G, 8)), (BLOCK_N, HALF))
                w_lo, w_hi = e2m1_scaled_bf16(b, s8)                           # [BN, BK/2] each
            else:
                s = fp8e4m3_to_f32(tl.load(scale_ptr + rows * (K // 16) + k0 // 16 + grp, mask=smask, other=0))
                b = b.to(tl.int32)
                w_lo = tl.reshape(tl.reshape(e2m1_value(b), (BLOCK_N, G, 8)) * s[:, :, None], (BLOCK_N, HALF))
                w_hi = tl.reshape(tl.reshape(e2m1_value(b >> 4), (BLOCK_N, G, 8)) * s[:, :, None], (BLOCK_N, HALF))
            xv = tl.load(x_ptr + mm * stride_xm + k0 + kk, mask=xmask, other=0.0)                   # [BM, BK]
            x_even, x_odd = tl.split(tl.reshape(xv, (BLOCK_M, HALF, 2)))
            x_even, x_odd = tl.trans(x_even), tl.trans(x_odd)                  # [BK/2, BM]
            if DOT_F32:
                acc += tl.dot(w_lo, x_even.to(tl.float32))
                acc += tl.dot(w_hi, x_odd.to(tl.float32))
            else:
                acc += tl.dot(w_lo.to(tl.bfloat16), x_even.to(tl.bfloat16))
                acc += tl.dot(w_hi.to(tl.bfloat16), x_odd.to(tl.bfloat16))
        acc *= tl.load(scale_2_ptr)
        omask = (rows < N) & (ms < M)
        optr = out_ptr + ms * stride_om + rows                                 # out[m, n] = acc[n, m]
        if SPLIT_K == 1:
            tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            tl.atomic_add(optr, acc, mask=omask)
    elif JOIN:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]                # [BN, 1]
        pair = tl.arange(0, HALF)[None, :]                                     # [1, BK/2]
        kk = tl.arange(0, BLOCK_K)[None, :]                                    # [1, BK]
        grp = tl.arange(0, G)[None, :]                                         # [1, G]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            b = tl.load(packed_ptr + rows * (K // 2) + k0 // 2 + pair, mask=(rows < N) & (k0 + 2 * pair < k_hi),
                        other=0).to(tl.int32)                                  # [BN, BK/2]
            w = tl.reshape(tl.join(e2m1_value(b), e2m1_value(b >> 4)), (BLOCK_N, BLOCK_K))   # k = 2 * pair + hi
            xv = tl.load(x_ptr + k0 + kk, mask=k0 + kk < k_hi, other=0.0).to(tl.float32)     # [1, BK] contiguous
            t = tl.sum(tl.reshape(w * xv, (BLOCK_N, G, 16)), axis=2)                          # [BN, G]
            s = fp8e4m3_to_f32(tl.load(scale_ptr + rows * (K // 16) + k0 // 16 + grp,
                                       mask=(rows < N) & (k0 + 16 * grp < k_hi), other=0))    # [BN, G]
            acc += tl.sum(t * s, axis=1)
        _store_row(acc, scale_2_ptr, out_ptr, pid_n, N, BLOCK_N, SPLIT_K)
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]          # [BN, 1, 1]
        grp = tl.arange(0, G)[None, :, None]                                   # [1, G, 1]
        j = tl.arange(0, 8)[None, None, :]                                     # [1, 1, 8]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            gmask = k0 + 16 * grp < k_hi                                       # [1, G, 1]
            b = tl.load(packed_ptr + rows * (K // 2) + k0 // 2 + grp * 8 + j, mask=(rows < N) & gmask, other=0)
            b = b.to(tl.int32)                                                 # [BN, G, 8]
            xo = k0 + 16 * grp + 2 * j
            x_even = tl.load(x_ptr + xo, mask=gmask, other=0.0).to(tl.float32)                     # [1, G, 8]
            x_odd = tl.load(x_ptr + xo + 1, mask=gmask, other=0.0).to(tl.float32)
            t = tl.sum(e2m1_value(b) * x_even + e2m1_value(b >> 4) * x_odd, axis=2)                # [BN, G]
            s = fp8e4m3_to_f32(tl.load(scale_ptr + rows * (K // 16) + k0 // 16 + grp,
                                       mask=(rows < N) & gmask, other=0))                          # [BN, G, 1]
            acc += tl.sum(t * tl.reshape(s, (BLOCK_N, G)), axis=1)
        _store_row(acc, scale_2_ptr, out_ptr, pid_n, N, BLOCK_N, SPLIT_K)


@functools.cache
def _has_bf16x2_mul(device: torch.device) -> bool:
    """mul.rn.bf16x2 (the prmt decode's block-scale multiply) needs sm_90."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def w4a16_gemv(x: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
               config: GemvConfig | None = None, scale_bf16: Tensor | None = None) -> Tensor:
    """x [M, K] (M <= 64; words configs M <= 16) @ dequant(packed [N, K/2], weight_scale [N, K/16],
    weight_scale_2).T -> [M, N] bf16.

    Same semantics as `w4a16_gemm_ref`; a CPU tensor needs TRITON_INTERPRET=1. scale_bf16 (weight_scale as bf16,
    exact) is what the PRMT tensor-core path reads; a caller that owns the weight keeps one, else it is made here.
    """
    n, k = check_packed(packed, weight_scale, weight_scale_2)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be a float [M, {k}] tensor, got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"w4a16_gemv handles M <= {GEMV_MAX_M}, got M = {m}")
    if x.stride(1) != 1:
        x = x.contiguous()
    mma_ok = active().gemv_mma and x.dtype == torch.bfloat16 and x.is_cuda and _has_bf16x2_mul(x.device)
    cfg = config or default_gemv_config(m, n, k, mma_ok=mma_ok)
    if cfg.mma:
        tiles, rest = divmod(cfg.block_n, 16 * cfg.num_warps)
        if m > 16 or not mma_fits(n, k) or rest or tiles not in (1, 2) or cfg.l2_fetch not in (0, 128, 256) \
                or cfg.unroll not in (1, 2) or k % (CHUNK_K.value * cfg.unroll):
            raise ValueError(f"bad GemvConfig {cfg} for M = {m}, [{n}, {k}]: the mma kernel needs M <= 16, "
                             f"K % (128 x unroll) == 0, N % 16 == 0 and block_n = 16 x (1 or 2) x num_warps")
        if not (x.is_cuda and _has_bf16x2_mul(x.device)):
            raise ValueError("the mma GEMV kernel runs on CUDA sm_90+ only")
        return _run_mma(x, packed, weight_scale, weight_scale_2, cfg)
    if cfg.words and m > 16:
        raise ValueError(f"the words kernel handles M <= 16, got M = {m} ({cfg})")
    if cfg.words:
        if cfg.block_k < 64 or cfg.block_k & (cfg.block_k - 1) or k % 16:
            raise ValueError(f"bad GemvConfig {cfg} for K = {k}: words needs a power-of-2 block_k >= 64, K % 16 == 0")
        return gemv_words(x, packed, weight_scale, weight_scale_2, cfg.block_n, cfg.block_k, cfg.split_k,
                          cfg.num_warps, cfg.num_stages)
    if cfg.block_k % 32 or cfg.block_k & (cfg.block_k - 1) or (cfg.use_dot and cfg.block_n < 16):
        raise ValueError(f"bad GemvConfig {cfg}: block_k must be a power of 2 >= 32, tensor cores need block_n >= 16")
    use_dot = cfg.use_dot or m > 1
    dot_f32 = not x.is_cuda or x.dtype == torch.float32
    if x.dtype == torch.float16 and use_dot and not dot_f32:
        x = x.to(torch.bfloat16)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split) if k else 1
    out = (torch.zeros if split > 1 else torch.empty)(m, n, device=x.device,
                                                       dtype=torch.float32 if split > 1 else torch.bfloat16)
    if m == 0 or n == 0:
        return out.to(torch.bfloat16)
    prmt = use_dot and cfg.prmt
    if prmt and scale_bf16 is not None and scale_bf16.shape != weight_scale.shape:
        raise ValueError(f"scale_bf16 must have weight_scale's shape {tuple(weight_scale.shape)}, "
                         f"got {tuple(scale_bf16.shape)}")
    if prmt and (scale_bf16 is None or scale_bf16.data_ptr() % 4 or not scale_bf16.is_contiguous()):
        scale_bf16 = weight_scale.to(torch.bfloat16)   # read as int32 pairs: 4-byte aligned, contiguous
    grid = (triton.cdiv(n, cfg.block_n), split)
    raw_scale = weight_scale.view(torch.uint8)
    _w4a16_gemv_kernel[grid](x, packed, raw_scale, scale_bf16 if prmt else raw_scale, weight_scale_2.float().reshape(1),
                             out, m, n, k, x.stride(0), out.stride(0), k_per_split,
                             BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, USE_DOT=use_dot,
                             DOT_F32=dot_f32, JOIN=cfg.join, PRMT=prmt and not dot_f32 and _has_bf16x2_mul(x.device),
                             EVEN_K=k % cfg.block_k == 0, BLOCK_M=max(16, triton.next_power_of_2(m)),
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(torch.bfloat16) if split > 1 else out
