"""Fused elementwise kernels for the decode step: RMSNorm (+ residual add), per-head q/k RMSNorm + neox RoPE, SwiGLU.

Each replaces a chain of small PyTorch kernels with one launch and reproduces the chain's rounding: math runs in
fp32 and every intermediate that torch materialises in bf16 is rounded to bf16 here too (`_round`, round to nearest
even by integer ops, so the Triton CPU interpreter, whose fp32 -> bf16 cast truncates, rounds the same way). Stores
then cast already-representable values. FMA contraction is off (`enable_fp_fusion=False`), since torch's separate
kernels round each product. On CUDA, exp and rsqrt are libdevice's (the functions torch calls). Reductions (the
RMSNorm mean of squares) run in a different order than torch's, so bf16 outputs may differ by one ulp where the
fp32 value lies next to a rounding boundary. Supported dtypes: bf16 and fp32. A CPU tensor needs TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from . import pdl
from .pdl import pdl_prologue

_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _round(x, BF16: tl.constexpr):
    """fp32 x -> the nearest bf16 value (ties to even), still fp32; the identity when BF16 is False."""
    if BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
        x = tl.where(x != x, x, b.to(tl.float32, bitcast=True))
    return x


@triton.jit
def _rsqrt(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.rsqrt(x)                                         # torch's CUDA rsqrt is rsqrtf
    else:
        y = tl.rsqrt(x)                                                # the interpreter: 1 / sqrt, as torch on CPU
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, stride_x, stride_r, inv_n, eps,
                     HAS_RES: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr, LIBDEVICE: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    mask = n < N
    x = tl.load(x_ptr + t * stride_x + n, mask=mask, other=0.0).to(tl.float32)                     # [BLOCK]
    if HAS_RES:
        x = _round(x + tl.load(res_ptr + t * stride_r + n, mask=mask, other=0.0).to(tl.float32), X_BF16)
        tl.store(res_out_ptr + t * N + n, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    rstd = _rsqrt(tl.sum(x * x, axis=0) * inv_n + eps, LIBDEVICE)
    y = _round(x * rstd, X_BF16)                                                                    # x.to(dtype)
    w = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + n, _round(w * y, OUT_BF16).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr,
                           slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                           stride_st, stride_cs, inv_d, eps,
                           H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                           X_BF16: tl.constexpr, NORM_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                           LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr):
    """Programs (t, h): h < H a q head, h < H + KV a k head, else (STORE only) a v head copied to the cache. With
    STORE, k and v go to cache slot slot_ptr[t] (none when it is negative) instead of ko_ptr."""
    pdl_prologue(PDL)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    ok = t >= 0
    if h < H:                                                          # a q head
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = qo_ptr + (t * H + h) * D
        w_ptr = qw_ptr
    elif STORE:                                                        # k or v, into cache slot slot_ptr[t]
        slot = tl.load(slot_ptr + t)
        ok = slot >= 0
        if h < H + KV:
            src = k_ptr + t * stride_kt + (h - H) * stride_kh
            dst = kc_ptr + slot * stride_cs + (h - H) * D
        else:                                                          # a v head: a copy
            src = v_ptr + t * stride_vt + (h - H - KV) * stride_vh
            dst = vc_ptr + slot * stride_cs + (h - H - KV) * D
        w_ptr = kw_ptr
    else:                                                              # a k head
        src = k_ptr + t * stride_kt + (h - H) * stride_kh
        dst = ko_ptr + (t * KV + h - H) * D
        w_ptr = kw_ptr
    i = tl.arange(0, BLOCK)
    mask = i < D // 2
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)                                      # [D/2]
    x2 = tl.load(src + D // 2 + i, mask=mask, other=0.0).to(tl.float32)
    if h < H + KV:
        if HAS_NORM:
            rstd = _rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) * inv_d + eps, LIBDEVICE)
            w1 = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + D // 2 + i, mask=mask, other=0.0).to(tl.float32)
            x1 = _round(w1 * _round(x1 * rstd, X_BF16), NORM_BF16)
            x2 = _round(w2 * _round(x2 * rstd, X_BF16), NORM_BF16)
        c1 = tl.load(cos_ptr + t * stride_ct + i, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + D // 2 + i, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_st + i, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_st + D // 2 + i, mask=mask, other=0.0).to(tl.float32)
        o1 = _round(_round(x1 * c1, OUT_BF16) + _round(-x2 * s1, OUT_BF16), OUT_BF16)             # x*cos + cat(-x2, x1)*sin
        o2 = _round(_round(x2 * c2, OUT_BF16) + _round(x1 * s2, OUT_BF16), OUT_BF16)
    else:
        o1, o2 = x1, x2
    tl.store(dst + i, o1.to(qo_ptr.dtype.element_ty), mask=mask & ok)
    tl.store(dst + D // 2 + i, o2.to(qo_ptr.dtype.element_ty), mask=mask & ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, BF16: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    mask = i < I
    g = tl.load(gu_ptr + t * stride_gu + i, mask=mask, other=0.0).to(tl.float32)                   # [BLOCK]
    u = tl.load(gu_ptr + t * stride_gu + I + i, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = _round(tl.math.div_rn(g, 1.0 + e), BF16)                                                   # F.silu(g)
    tl.store(out_ptr + t * I + i, _round(s * u, BF16).to(out_ptr.dtype.element_ty), mask=mask)


def _check_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be bf16 or fp32, got {t.dtype}")


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim, as models.layers.RMSNorm: x [T, N] (any row stride), weight [N] -> out [T, N].

    out dtype = promote(weight.dtype, x.dtype). With residual [T, N] (x's dtype) returns (out, new_residual) where
    new_residual = x + residual in x's dtype and out = RMSNorm(new_residual). Outputs are new contiguous tensors.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, N] with unit column stride, got {tuple(x.shape)} strides {x.stride()}")
    t, n = x.shape
    _check_dtype("x", x)
    _check_dtype("weight", weight)
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must be a unit-column-stride {x.dtype} {tuple(x.shape)} tensor")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(t, n, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if t:
        block = triton.next_power_of_2(n)
        res = residual if residual is not None else x
        on, opts = pdl.launch(x)
        _rms_norm_kernel[(t,)](x, res, weight.contiguous(), out, res_out if res_out is not None else out, n,
                               x.stride(0), res.stride(0), 1.0 / n, eps, HAS_RES=residual is not None,
                               X_BF16=x.dtype == torch.bfloat16, OUT_BF16=out_dtype == torch.bfloat16,
                               LIBDEVICE=x.is_cuda, BLOCK=block, PDL=on, num_warps=_warps(block),
                               enable_fp_fusion=False, **opts)
    return out if residual is None else (out, res_out)


def qk_norm_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                   eps: float, cache: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
                   ) -> tuple[Tensor, Tensor | None]:
    """Optional per-head RMSNorm (Qwen3 q_norm / k_norm) then neox RoPE, in one launch over (T, H + KV) heads.

    q [T, H, D], k [T, KV, D]: any token and head strides, unit stride inside a head (views of a fused qkv output
    qkv[:, :H*D].view(T, H, D) work). cos, sin [T, 1, D] (unit last stride). q_weight, k_weight [D] or both None.
    Returns contiguous (q_out [T, H, D], k_out [T, KV, D]) equal to
    Rotary.apply(q_norm(q), cos, sin) and Rotary.apply(k_norm(k), cos, sin), in the dtype torch's promotion gives.
    With cache = (v [T, KV, D], k_cache, v_cache [blocks, block_size, KV, D], slot_mapping [T]) the same launch
    writes k_out and v into the caches instead (attention.store_kv; negative slots are skipped) and returns
    (q_out, None).
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q, k must be [T, H, D], [T, KV, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    t, h, d = q.shape
    kv = k.shape[1]
    if d % 2 or q.stride(2) != 1 or k.stride(2) != 1 or q.dtype != k.dtype:
        raise ValueError("q, k need an even head dim, unit stride inside a head and one dtype")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape != (t, 1, d) or c.stride(2) != 1:
            raise ValueError(f"{name} must be [{t}, 1, {d}] with unit last stride, got {tuple(c.shape)}")
    if cos.dtype != sin.dtype:
        raise ValueError("cos and sin need one dtype")
    _check_dtype("q", q)
    _check_dtype("cos", cos)
    has_norm = q_weight is not None
    if has_norm != (k_weight is not None):
        raise ValueError("pass both q_weight and k_weight or neither")
    norm_dtype = q.dtype
    if has_norm:
        if q_weight.shape != (d,) or k_weight.shape != (d,) or q_weight.dtype != k_weight.dtype:
            raise ValueError(f"q_weight and k_weight must be [{d}] of one dtype")
        _check_dtype("q_weight", q_weight)
        norm_dtype = torch.promote_types(q_weight.dtype, q.dtype)
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    out_dtype = torch.promote_types(norm_dtype, cos.dtype)
    q_out = torch.empty(t, h, d, dtype=out_dtype, device=q.device)
    store = cache is not None
    if store:
        v, k_cache, v_cache, slots = cache
        if v.shape != k.shape or v.stride(2) != 1 or k_cache.dtype != out_dtype or v_cache.dtype != out_dtype \
                or k_cache.shape != v_cache.shape or k_cache.shape[-2:] != (kv, d) or slots.shape != (t,):
            raise ValueError("the cache write needs v like k, caches [blocks, block_size, KV, D] in the output "
                             f"dtype {out_dtype} and one slot per token")
        for c in (k_cache, v_cache):
            if c.stride(3) != 1 or c.stride(2) != d or c.stride(0) != c.shape[1] * c.stride(1):
                raise ValueError("the caches' (block, offset) dims must flatten to slots of contiguous heads")
        k_out, grid_heads = None, h + 2 * kv
    else:
        v, k_cache, v_cache, slots = k, q_out, q_out, q_out                  # unused placeholders
        k_out, grid_heads = torch.empty(t, kv, d, dtype=out_dtype, device=q.device), h + kv
    if t:
        block = triton.next_power_of_2(d // 2)
        qw, kw = (q_weight, k_weight) if has_norm else (cos, cos)            # unused placeholders without the norm
        on, opts = pdl.launch(q)
        _qk_norm_rotary_kernel[(t, grid_heads)](
            q, k, v, cos, sin, qw, kw, q_out, k_out if k_out is not None else q_out, k_cache, v_cache, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), k_cache.stride(1) if store else 0, 1.0 / d, eps, H=h, KV=kv, D=d, HAS_NORM=has_norm,
            X_BF16=q.dtype == torch.bfloat16, NORM_BF16=norm_dtype == torch.bfloat16,
            OUT_BF16=out_dtype == torch.bfloat16, LIBDEVICE=q.is_cuda, BLOCK=block, STORE=store, PDL=on,
            num_warps=1 if block <= 64 else 2, enable_fp_fusion=False, **opts)
    return q_out, k_out


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU activation: gate_up [T, 2I] (any row stride) -> F.silu(gate_up[:, :I]) * gate_up[:, I:], contiguous [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with unit column stride, got {tuple(gate_up.shape)}")
    _check_dtype("gate_up", gate_up)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t and inter:
        block = min(1024, triton.next_power_of_2(inter))
        on, opts = pdl.launch(gate_up)
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0),
                                                          BF16=gate_up.dtype == torch.bfloat16,
                                                          LIBDEVICE=gate_up.is_cuda, BLOCK=block, PDL=on,
                                                          num_warps=_warps(block), enable_fp_fusion=False, **opts)
    return out
