"""NVFP4 quantize / dequantize as Triton kernels, and the decode helpers the other NVFP4 kernels share.

Byte-exact with `nvfp4_ref`: fp8 rounding is done in integer arithmetic, divisions with `div_rn`.
Imported only when a Triton path runs (`nvfp4.py` dispatches), so CPU installs need no triton.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .nvfp4_ref import GROUP_SIZE, check_packed

_ROWS = 16    # rows per program
_GROUPS = 8   # 16-element groups per program (128 elements)


@triton.jit
def e2m1_times(code, scale):
    """4-bit codes (int32) times fp32 `scale` -> fp32; exact, branch-free.

    (code & 7) << 9 puts the E2M1 exponent/mantissa bits under fp16's, which reads as value * 2**-14.
    """
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    half = bits.to(tl.uint16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * (scale * 16384.0)


@triton.jit
def fp8e4m3_to_f32(raw):
    """Raw non-negative float8_e4m3fn bytes (uint8) -> fp32 with integer ops only (no cvt, no denormals)."""
    r = raw.to(tl.int32)
    f = (((r & 0x7F) << 20) + 0x3C000000).to(tl.float32, bitcast=True)   # (1 + m/8) * 2**(e-7)
    return tl.where((r & 0x78) == 0, 2.0 * f - 0.015625, f)              # e == 0: m * 2**-9


@triton.jit
def _f32_to_fp8e4m3(x):
    """Positive fp32 in [2**-9, 448] -> float8_e4m3fn byte, round half to even (as torch's cast)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20       # drop 20 mantissa bits, RNE
    normal = rounded - ((127 - 7) << 3)
    sub = ((x * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)     # RNE to a multiple of 2**-9
    return tl.where(bits < (121 << 23), sub, normal)             # exponent < -6: subnormal


@triton.jit
def _e2m1_code(x):
    """fp32 (already scaled) -> 4-bit code, ties to even on ModelOpt's bounds; sign kept for x < 0."""
    a = tl.abs(x)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    return mag | ((x < 0).to(tl.int32) << 3)


@triton.jit
def _quantize_kernel(w_ptr, packed_ptr, scale_ptr, scale_2_ptr, N, K, stride_w,
                     ROWS: tl.constexpr, GROUPS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]     # [R, 1, 1]
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
    pairs = tl.arange(0, 8)[None, None, :]                                  # [1, 1, 8]
    mask = (rows < N) & (groups < K // 16)
    col = groups * 16 + pairs * 2
    lo = tl.load(w_ptr + rows * stride_w + col, mask=mask, other=0.0).to(tl.float32)       # [R, G, 8]
    hi = tl.load(w_ptr + rows * stride_w + col + 1, mask=mask, other=0.0).to(tl.float32)
    g2 = tl.load(scale_2_ptr)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))            # [R, G]
    s = tl.math.div_rn(amax, 6.0 * g2)
    s = tl.where((s == 0) | (s != s), 1.0, s)
    code = _f32_to_fp8e4m3(tl.minimum(tl.maximum(s, 0.001953125), 448.0))
    denom = (fp8e4m3_to_f32(code) * g2)[:, :, None]                                      # [R, G, 1]
    safe = tl.where(denom > 0, denom, 1.0)
    q_lo = _e2m1_code(tl.where(denom > 0, tl.math.div_rn(lo, safe), 0.0))
    q_hi = _e2m1_code(tl.where(denom > 0, tl.math.div_rn(hi, safe), 0.0))
    tl.store(packed_ptr + rows * (K // 2) + groups * 8 + pairs, (q_lo | (q_hi << 4)).to(tl.uint8), mask=mask)
    rows2 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]          # [R, 1]
    groups2 = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[None, :]    # [1, G]
    tl.store(scale_ptr + rows2 * (K // 16) + groups2, code.to(tl.uint8), mask=(rows2 < N) & (groups2 < K // 16))


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, scale_2_ptr, out_ptr, N, K,
                       ROWS: tl.constexpr, GROUPS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]     # [R, 1, 1]
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
    pairs = tl.arange(0, 8)[None, None, :]                                  # [1, 1, 8]
    mask = (rows < N) & (groups < K // 16)
    b = tl.load(packed_ptr + rows * (K // 2) + groups * 8 + pairs, mask=mask, other=0).to(tl.int32)
    raw = tl.load(scale_ptr + rows * (K // 16) + groups, mask=mask, other=0)    # [R, G, 1]
    s = fp8e4m3_to_f32(raw) * tl.load(scale_2_ptr)
    col = groups * 16 + pairs * 2
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows * K + col, e2m1_times(b & 0xF, s).to(ty), mask=mask)
    tl.store(out_ptr + rows * K + col + 1, e2m1_times(b >> 4, s).to(ty), mask=mask)


def _grid(n: int, k: int) -> tuple[int, int]:
    return triton.cdiv(n, _ROWS), triton.cdiv(k // GROUP_SIZE, _GROUPS)


def quantize(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton path of nvfp4.quantize."""
    if w.dim() != 2 or w.shape[1] % GROUP_SIZE or not w.is_floating_point():
        raise ValueError(f"quantize expects a float [N, K] weight with K % 16 == 0, got {w.dtype} {tuple(w.shape)}")
    w = w.contiguous()
    n, k = w.shape
    amax = w.abs().amax().float() if w.numel() else w.new_zeros((), dtype=torch.float32)
    scale_2 = amax / amax.new_tensor(6.0 * 448.0)  # a device divisor: CUDA divides by a host scalar as x * (1/s)
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, k // GROUP_SIZE, dtype=torch.uint8, device=w.device)
    if w.numel():
        _quantize_kernel[_grid(n, k)](w, packed, scale, scale_2, n, k, w.stride(0), ROWS=_ROWS, GROUPS=_GROUPS)
    return packed, scale.view(torch.float8_e4m3fn), scale_2


def dequantize(packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The Triton path of nvfp4.dequantize."""
    n, k = check_packed(packed, weight_scale, weight_scale_2)
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    if out.numel():
        _dequantize_kernel[_grid(n, k)](packed.contiguous(), weight_scale.contiguous().view(torch.uint8),
                                        weight_scale_2.float().reshape(1), out, n, k,
                                        ROWS=_ROWS, GROUPS=_GROUPS)
    return out
