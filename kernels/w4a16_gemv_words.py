"""W4A16 GEMV on CUDA cores with 32-bit weight words: x [M, K] (M <= 16) @ NVFP4 [N, K]^T -> bf16 [M, N].

The packed weight is read as int32 [N, K/8] (code i of word w = element 8w + i, bits 4i..4i+3). Each thread owns one
word column and BLOCK_N rows: a warp's load of a row is 128 contiguous bytes, and the thread's 8 x values of that
word are one 16-byte load of x [BM, 1, W, 8], in the same thread mapping (K8 is left unspecialized so Triton does not
vectorize the word loads into a layout that would need conversions).

Decode: `spread_signs` (7 ops per word) leaves each code's magnitude bits (e, m) and its sign 9 bits apart, so one
shift and one and put them under fp32's exponent LSBs / mantissa MSB and sign bit: exactly E2M1 * 2**-126, e == 0
being a true subnormal (0 and 0.5 need no patching). fp32 FMAs keep subnormals (Triton emits no .ftz); every product
is brought back into the normal range by a power of two, undone with weight_scale_2 at the end:

* BLOCK_M == 1: x is pre-scaled by 2**64 (so |x| < 2**64); per word t = sum_i code_i * x_i, acc += t * fp8 scale.
* BLOCK_M > 1: the fp8 scale times 2**100 is folded into the decoded codes once, shared by the M rows of x.

The fp8 scale is decoded the same way (raw e4m3 bits << 20 are its value * 2**-120). Exact up to the fp32 summation
order (and the underflow of products below ~2**-64 resp. 2**-100).
Split-K adds fp32 partials into a persistent, zeroed workspace per (device, N, tiles); the last program of an N tile
(a counter per tile) writes bf16 and re-zeroes its workspace tile and counter, so a call is one kernel. Calls that
share a workspace must not run concurrently on different streams.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

_X_SHIFT = tl.constexpr(2.0 ** 64)      # BLOCK_M == 1: x * 2**64 keeps x * code * 2**-126 normal
_S_SHIFT = tl.constexpr(2.0 ** 120)     # fp8 bits << 20 -> value
_W_SHIFT = tl.constexpr(2.0 ** 100)     # BLOCK_M > 1: code * 2**-126 * scale * 2**100 is normal
_UNSHIFT_1 = tl.constexpr(2.0 ** 62)    # undoes 2**-126 * 2**64
_UNSHIFT_M = tl.constexpr(2.0 ** 26)    # undoes 2**-126 * 2**100
_WORKSPACE: dict[tuple, tuple[Tensor, Tensor]] = {}


@triton.jit
def spread_signs(q):
    """int32 words q (8 E2M1 codes, code i in bits 4i..4i+3) -> (za, zb): codes 0, 1, 4, 5 (za) and 2, 3, 6, 7 (zb)
    each with its magnitude at bit P in 0, 4, 16, 20 and its sign moved to bit P + 9."""
    za = (q & 0x00770077) | ((q << 6) & 0x22002200)
    zb = ((q >> 8) & 0x00770077) | ((q >> 2) & 0x22002200)
    return za, zb


@triton.jit
def e2m1_subnormal(za, zb, j):
    """za, zb [..., 1] from spread_signs, j [..., 8] = 0..7 -> code j as fp32 E2M1 value * 2**-126, [..., 8].
    j lives inside one thread, so the shifts and the za / zb choice fold to constants per register."""
    p = (j % 2) * 4 + (j // 4) * 16
    z = tl.where((j // 2) % 2 == 0, za, zb)
    return ((z << (22 - p)) & -0x7E400000).to(tl.float32, bitcast=True)          # mask 0x81C00000


@triton.jit(do_not_specialize=["K8", "SPLIT_K"])   # K8 unaligned: one word per thread, the layout of the x loads
def _gemv_words_kernel(x_ptr, q_ptr, scale_ptr, scale_2_ptr, out_ptr, work_ptr, count_ptr, M, N, K8, K16,
                       stride_xm, stride_om, WORDS_PER_SPLIT, SPLIT_K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    W: tl.constexpr = BLOCK_K // 8
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    w_lo = pid_k * WORDS_PER_SPLIT
    w_hi = tl.minimum(w_lo + WORDS_PER_SPLIT, K8)
    ms = tl.arange(0, BLOCK_M)[:, None, None, None]                            # [BM, 1, 1, 1]
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None, None]        # [1, BN, 1, 1]
    words = tl.arange(0, W)[None, None, :, None]                               # [1, 1, W, 1]
    j = tl.arange(0, 8)[None, None, None, :]                                   # [1, 1, 1, 8] code in the word
    acc = tl.zeros((BLOCK_M, BLOCK_N, W), dtype=tl.float32)
    for w0 in range(w_lo, w_hi, W):
        kmask = w0 + words < w_hi                                              # [1, 1, W, 1]
        wmask = (rows < N) & kmask
        q = tl.load(q_ptr + rows * K8 + w0 + words, mask=wmask, other=0)      # [1, BN, W, 1] int32
        raw = tl.load(scale_ptr + rows * K16 + (w0 + words) // 2, mask=wmask, other=0).to(tl.int32)
        s = (raw << 20).to(tl.float32, bitcast=True) * _S_SHIFT            # [1, BN, W, 1] fp8 scale per word
        za, zb = spread_signs(q)
        w = e2m1_subnormal(za, zb, j)                                          # [1, BN, W, 8]
        x = tl.load(x_ptr + ms * stride_xm + 8 * (w0 + words) + j, mask=(ms < M) & kmask,
                    other=0.0).to(tl.float32)                                  # [BM, 1, W, 8], 16 B per thread
        if BLOCK_M == 1:
            acc += tl.sum(w * (x * _X_SHIFT), axis=3) * tl.reshape(s, (1, BLOCK_N, W))
        else:
            acc += tl.sum((w * (s * _W_SHIFT)) * x, axis=3)
    if BLOCK_M == 1:
        res = tl.sum(acc, axis=2) * (tl.load(scale_2_ptr) * _UNSHIFT_1)        # [BM, BN]
    else:
        res = tl.sum(acc, axis=2) * (tl.load(scale_2_ptr) * _UNSHIFT_M)
    m2 = tl.arange(0, BLOCK_M)[:, None]                                         # [BM, 1]
    n2 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]                       # [1, BN]
    omask = (m2 < M) & (n2 < N)
    if not ATOMIC:
        tl.store(out_ptr + m2 * stride_om + n2, res.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        wp = work_ptr + m2 * N + n2                                             # workspace fp32 [16, N]
        tl.atomic_add(wp, res, mask=omask, sem="relaxed")
        tl.debug_barrier()                                                      # all partials issued first
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:  # the tile's last split
            total = tl.load(wp, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + m2 * stride_om + n2, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.store(wp, tl.zeros_like(total), mask=omask)
            tl.store(count_ptr + pid_n, 0)


def _workspace(device: torch.device, n: int, tiles: int) -> tuple[Tensor, Tensor]:
    """Zeroed fp32 [16, n] partial sums and int32 [tiles] counters, reused across calls (kept zero by the kernel)."""
    key = (device, n, tiles)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = (torch.zeros(16, n, device=device, dtype=torch.float32),
                           torch.zeros(tiles, device=device, dtype=torch.int32))
    return _WORKSPACE[key]


def gemv_words(x: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, block_n: int,
               block_k: int, split_k: int, num_warps: int, num_stages: int) -> Tensor:
    """x [M, K] (M <= 16, unit stride along K) @ NVFP4 [N, K]^T -> bf16 [M, N]; arguments checked by w4a16_gemv."""
    m, k = x.shape
    n = packed.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    if m == 0 or n == 0:
        return out
    q = packed.contiguous().view(torch.int32)                                   # [N, K/8]
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split = triton.cdiv(k, k_per_split) if k else 1
    tiles = triton.cdiv(n, block_n)
    work, count = _workspace(x.device, n, tiles) if split > 1 else (out, out)
    _gemv_words_kernel[(tiles, split)](x, q, weight_scale.contiguous().view(torch.uint8),
                                       weight_scale_2.float().reshape(1), out, work, count, m, n, k // 8, k // 16,
                                       x.stride(0), out.stride(0), k_per_split // 8, split,
                                       BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
                                       ATOMIC=split > 1, num_warps=num_warps, num_stages=num_stages)
    return out
