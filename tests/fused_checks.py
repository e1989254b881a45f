"""Shared by the CPU (interpreter) and GPU tests of kernels/fused_ops.py: bf16 distance, seeded norms, and the
q/k norm + RoPE check against the models/layers.py modules (each file passes its own tolerance as `match`)."""

from typing import Callable

import torch

EPS = 1e-6


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> int:
    """Largest distance in bf16 steps (ordered bit patterns)."""
    def ordered(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return int((ordered(got) - ordered(ref)).abs().max()) if got.numel() else 0


def seeded_norm(dim: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    from dspark_serve.models.layers import RMSNorm

    m = RMSNorm(dim, EPS).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    m.weight.data = (1 + 0.3 * torch.randn(dim, device=device, generator=g)).to(dtype)
    return m


def check_qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_norm: bool,
                         match: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """qk_norm_rotary against Rotary.apply(q_norm(q)) / Rotary.apply(k_norm(k)); bitwise without the norm."""
    from dspark_serve.kernels.fused_ops import qk_norm_rotary
    from dspark_serve.models.layers import Rotary

    d, dev = q.shape[-1], str(q.device)
    qn, kn = (seeded_norm(d, q.dtype, 2, dev), seeded_norm(d, q.dtype, 3, dev)) if qk_norm else (None, None)
    want_q = Rotary.apply(qn(q) if qk_norm else q, cos, sin)
    want_k = Rotary.apply(kn(k) if qk_norm else k, cos, sin)
    got_q, got_k = qk_norm_rotary(q, k, cos, sin, qn.weight.data if qk_norm else None,
                                  kn.weight.data if qk_norm else None, EPS)
    match(got_q, want_q)
    match(got_k, want_k)
    if not qk_norm:  # no reduction: exact in both dtypes
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def check_cache_write(h: int, kv: int, d: int, qk_norm: bool, dtype: torch.dtype, device: str = "cpu") -> None:
    """qk_norm_rotary with `cache` == qk_norm_rotary, then attention.store_kv: the same q and bitwise the same
    caches; a negative slot writes nothing."""
    from dspark_serve.kernels.attention import store_kv
    from dspark_serve.kernels.fused_ops import qk_norm_rotary
    from dspark_serve.models.layers import Rotary

    t, blocks, bs = 5, 4, 8
    g = torch.Generator(device=device).manual_seed(h + kv + d)
    qkv = (2 * torch.randn(t, (h + 2 * kv) * d, device=device, generator=g)).to(dtype)
    q, k, v = (qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kv) * d].view(t, kv, d),
               qkv[:, (h + kv) * d:].view(t, kv, d))
    cos, sin = Rotary(d, 1e6).to(device).cos_sin(torch.tensor([0, 1, 17, 300, 4095], device=device), dtype)
    qn, kn = (seeded_norm(d, dtype, 2, device), seeded_norm(d, dtype, 3, device)) if qk_norm else (None, None)
    w = (qn.weight.data, kn.weight.data) if qk_norm else (None, None)
    slots = torch.tensor([3, 30, -1, 9, 17], device=device)
    want = torch.randn(2, blocks, bs, kv, d, device=device, generator=g).to(dtype)  # old contents stay elsewhere
    got = want.clone()
    want_q, want_k = qk_norm_rotary(q, k, cos, sin, *w, EPS)
    store_kv(want_k, v, want[0], want[1], slots)
    got_q, none = qk_norm_rotary(q, k, cos, sin, *w, EPS, (v, got[0], got[1], slots))
    assert none is None and torch.equal(got_q, want_q)
    assert torch.equal(got, want)
