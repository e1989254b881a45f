"""DSpark's per-row distillation terms fused: one program per row streams the vocabulary of the draft logits
and of their target row twice forward (softmax statistics and argmax, then L1 and sum(sign * p)) and once
backward, in fp32 registers; nothing of size [R, V] is materialized but the gradient. Reference and semantics:
distill_loss_ref.py (same signature).

With p = softmax(z), q = softmax(t), s = sign(p - q):
  d ce / d z = p - onehot(label),   d l1 / d z = p * (s - sum_i s_i p_i).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 2048


@triton.jit
def _distill_fwd_kernel(z_ptr, t_ptr, trow_ptr, label_ptr, ce_ptr, l1_ptr, amax_ptr, lse_ptr, sp_ptr, V,
                        stride_z, stride_t, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    trow = tl.load(trow_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    zp, tp = z_ptr + row * stride_z, t_ptr + trow * stride_t
    mz = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    mt = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    sz = tl.zeros((BLOCK_V,), tl.float32)
    st = tl.zeros((BLOCK_V,), tl.float32)
    best = tl.full((BLOCK_V,), 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):                                   # pass 1: per-lane online max / sum, argmax
        m = v0 + cols < V
        z = tl.load(zp + v0 + cols, mask=m, other=float("-inf")).to(tl.float32)
        t = tl.load(tp + v0 + cols, mask=m, other=float("-inf")).to(tl.float32)
        best = tl.where(z > mz, v0 + cols, best)                      # strictly greater: the first index wins
        nz, nt = tl.maximum(mz, z), tl.maximum(mt, t)
        sz = sz * tl.exp(tl.where(nz == float("-inf"), 0.0, mz - nz)) + tl.where(m, tl.exp(z - nz), 0.0)
        st = st * tl.exp(tl.where(nt == float("-inf"), 0.0, mt - nt)) + tl.where(m, tl.exp(t - nt), 0.0)
        mz, mt = nz, nt
    gz, gt = tl.max(mz, 0), tl.max(mt, 0)
    lse_z = gz + tl.log(tl.sum(sz * tl.exp(mz - gz), 0))
    lse_t = gt + tl.log(tl.sum(st * tl.exp(mt - gt), 0))
    amax = tl.min(tl.where(mz == gz, best, 2147483647), 0)
    l1 = tl.zeros((BLOCK_V,), tl.float32)
    sp = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):                                   # pass 2: sum |p - q|, sum sign(p - q) p
        m = v0 + cols < V
        p = tl.exp(tl.load(zp + v0 + cols, mask=m, other=float("-inf")).to(tl.float32) - lse_z)
        q = tl.exp(tl.load(tp + v0 + cols, mask=m, other=float("-inf")).to(tl.float32) - lse_t)
        d = p - q
        l1 += tl.abs(d)
        sp += tl.where(d > 0, p, tl.where(d < 0, -p, 0.0))
    label = tl.load(label_ptr + row).to(tl.int64)
    tl.store(ce_ptr + row, lse_z - tl.load(zp + label).to(tl.float32))
    tl.store(l1_ptr + row, tl.sum(l1, 0))
    tl.store(amax_ptr + row, amax.to(tl.int64))
    tl.store(lse_ptr + 2 * row, lse_z)
    tl.store(lse_ptr + 2 * row + 1, lse_t)
    tl.store(sp_ptr + row, tl.sum(sp, 0))


@triton.jit
def _distill_bwd_kernel(z_ptr, t_ptr, trow_ptr, label_ptr, lse_ptr, sp_ptr, gce_ptr, gl1_ptr, gz_ptr, V,
                        stride_z, stride_t, stride_g, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    trow = tl.load(trow_ptr + row).to(tl.int64)
    label = tl.load(label_ptr + row)
    lse_z, lse_t = tl.load(lse_ptr + 2 * row), tl.load(lse_ptr + 2 * row + 1)
    sp, gce, gl1 = tl.load(sp_ptr + row), tl.load(gce_ptr + row), tl.load(gl1_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        m = v0 + cols < V
        p = tl.exp(tl.load(z_ptr + row * stride_z + v0 + cols, mask=m, other=float("-inf")).to(tl.float32) - lse_z)
        q = tl.exp(tl.load(t_ptr + trow * stride_t + v0 + cols, mask=m, other=float("-inf")).to(tl.float32) - lse_t)
        d = p - q
        s = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        g = gce * (p - tl.where(v0 + cols == label, 1.0, 0.0)) + gl1 * p * (s - sp)
        tl.store(gz_ptr + row * stride_g + v0 + cols, g.to(gz_ptr.dtype.element_ty), mask=m)


class _DistillRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor, t: Tensor, target_row: Tensor, labels: Tensor):
        r, v = z.shape
        ce, l1 = (torch.empty(r, device=z.device, dtype=torch.float32) for _ in range(2))
        amax = torch.empty(r, device=z.device, dtype=torch.int64)
        lse = torch.empty(r, 2, device=z.device, dtype=torch.float32)
        sp = torch.empty(r, device=z.device, dtype=torch.float32)
        if r:
            _distill_fwd_kernel[(r,)](z, t, target_row, labels, ce, l1, amax, lse, sp, v, z.stride(0), t.stride(0),
                                      BLOCK_V=BLOCK_V, num_warps=8)
        ctx.save_for_backward(z, t, target_row, labels, lse, sp)
        ctx.mark_non_differentiable(amax)
        return ce, l1, amax

    @staticmethod
    def backward(ctx, g_ce: Tensor | None, g_l1: Tensor | None, _g_amax):
        z, t, target_row, labels, lse, sp = ctx.saved_tensors
        r, v = z.shape
        zero = torch.zeros(r, device=z.device, dtype=torch.float32)
        g_ce = zero if g_ce is None else g_ce.float().contiguous()
        g_l1 = zero if g_l1 is None else g_l1.float().contiguous()
        gz = torch.empty_like(z)
        if r:
            _distill_bwd_kernel[(r,)](z, t, target_row, labels, lse, sp, g_ce, g_l1, gz, v, z.stride(0),
                                      t.stride(0), gz.stride(0), BLOCK_V=BLOCK_V, num_warps=8)
        return gz, None, None, None


def distill_rows(draft_logits: Tensor, target_logits: Tensor, target_row: Tensor,
                 labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """See distill_loss_ref.distill_rows_ref; CUDA tensors (or CPU under TRITON_INTERPRET=1), any float dtype,
    gradient into draft_logits only (in its dtype)."""
    if draft_logits.dim() != 2 or target_logits.dim() != 2 or draft_logits.shape[1] != target_logits.shape[1]:
        raise ValueError(f"draft logits [R, V] and target logits [U, V] expected, got "
                         f"{tuple(draft_logits.shape)} and {tuple(target_logits.shape)}")
    r = draft_logits.shape[0]
    if tuple(target_row.shape) != (r,) or tuple(labels.shape) != (r,):
        raise ValueError(f"target_row and labels must be [{r}], got {tuple(target_row.shape)}, "
                         f"{tuple(labels.shape)}")
    if draft_logits.stride(1) != 1 or target_logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    return _DistillRows.apply(draft_logits, target_logits.detach(), target_row.contiguous(), labels.contiguous())
