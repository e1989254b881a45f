"""The top-k Markov walk in one launch: one program per request loops over the N draft positions (W1 row gather,
the K candidates' W2 rows against it, the add, argmax or Gumbel-argmax, d2t, the confidence logit) and chains
prev. fp32 math; the reference and the semantics are in markov_walk_ref.py (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _markov_walk_kernel(values_ptr, cand_ptr, w2_ptr, w1_ptr, anchor_ptr, d2t_ptr, conf_base_ptr, conf_w_ptr,
                        noise_ptr, temp_ptr, sampled_ptr, tokens_ptr, logits_ptr, conf_ptr, scale,
                        N: tl.constexpr, K: tl.constexpr, RANK: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, HAS_D2T: tl.constexpr, HAS_CONF: tl.constexpr,
                        HAS_CONF_W: tl.constexpr, HAS_NOISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)                                                  # candidates
    rr = tl.arange(0, BLOCK_R)                                                  # rank
    kmask, rmask = kk < K, rr < RANK
    prev = tl.load(anchor_ptr + row)
    if HAS_NOISE:
        is_sampled = tl.load(sampled_ptr + row) != 0
        temp = tl.load(temp_ptr + row)
    if HAS_CONF_W:
        cw = tl.load(conf_w_ptr + rr, mask=rmask, other=0.0).to(tl.float32)
    for k in range(N):
        base = (row * N + k) * K
        e = tl.load(w1_ptr + prev * RANK + rr, mask=rmask, other=0.0).to(tl.float32)             # [BR]
        w = tl.load(w2_ptr + (base + kk[:, None]) * RANK + rr[None, :], mask=kmask[:, None] & rmask[None, :],
                    other=0.0).to(tl.float32)                                                   # [BK, BR]
        lg = tl.load(values_ptr + base + kk, mask=kmask, other=0.0) + scale * tl.sum(w * e[None, :], 1)
        tl.store(logits_ptr + base + kk, lg, mask=kmask)
        sel = lg
        if HAS_NOISE:
            noisy = tl.math.div_rn(lg, temp) + tl.load(noise_ptr + base + kk, mask=kmask, other=0.0)
            sel = tl.where(is_sampled, noisy, lg)
        sel = tl.where(kmask, sel, float("-inf"))
        cand = tl.load(cand_ptr + base + kk, mask=kmask, other=0)
        best = tl.max(sel, 0)
        draft = tl.min(tl.where((sel == best) & kmask, cand, 9223372036854775807), 0)     # ties: smallest id
        if HAS_D2T:
            draft += tl.load(d2t_ptr + draft)
        tl.store(tokens_ptr + row * N + k, draft)
        if HAS_CONF:
            c = tl.load(conf_base_ptr + row * N + k)
            if HAS_CONF_W:
                c += tl.sum(e * cw, 0)
            tl.store(conf_ptr + row * N + k, c)
        prev = draft


def markov_walk(values: Tensor, cand: Tensor, w2_rows: Tensor, w1: Tensor, anchor: Tensor, scale: float,
                d2t: Tensor | None = None, conf_base: Tensor | None = None, conf_w: Tensor | None = None,
                noise: Tensor | None = None, temperature: Tensor | None = None,
                sampled: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """See markov_walk_ref.markov_walk_ref; all tensors on one device (CUDA, or CPU under TRITON_INTERPRET=1)."""
    num, n, k = values.shape
    rank = w1.shape[1]
    if tuple(cand.shape) != (num, n, k) or tuple(w2_rows.shape) != (num, n, k, rank):
        raise ValueError(f"cand must be [{num}, {n}, {k}] and w2_rows [{num}, {n}, {k}, {rank}], got "
                         f"{tuple(cand.shape)} and {tuple(w2_rows.shape)}")
    if noise is not None and (temperature is None or sampled is None):
        raise ValueError("noise needs temperature and sampled")
    dev = values.device
    tokens = torch.empty(num, n, dtype=torch.int64, device=dev)
    logits = torch.empty(num, n, k, dtype=torch.float32, device=dev)
    conf = torch.empty(num, n, dtype=torch.float32, device=dev) if conf_base is not None else None
    dummy = tokens  # never read: its flag is off
    c = lambda t: t.contiguous() if t is not None else dummy  # noqa: E731
    _markov_walk_kernel[(num,)](
        c(values.float()), c(cand.long()), c(w2_rows), c(w1), c(anchor.long()), c(d2t), c(conf_base),
        c(conf_w), c(noise), c(temperature), c(sampled), tokens, logits, conf if conf is not None else dummy,
        float(scale), N=n, K=k, RANK=rank, BLOCK_K=triton.next_power_of_2(k), BLOCK_R=triton.next_power_of_2(rank),
        HAS_D2T=d2t is not None, HAS_CONF=conf_base is not None, HAS_CONF_W=conf_w is not None,
        HAS_NOISE=noise is not None)
    return tokens, logits, conf
