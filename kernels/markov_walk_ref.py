"""The top-k Markov walk (DSpark's sequential stage over dspark_draft_topk candidates), plain PyTorch.

Candidates are chosen once per position from the base logits U (values, cand = U.topk(K)); the walk then only
touches those K columns: for k = 0..N-1, e = W1[prev]; L = values[k] + scale * W2[cand[k]] @ e; pick the argmax
of L (greedy rows) or of L / T + Gumbel noise (sampled rows), ties to the smallest draft id (a dense argmax over a
-inf-filled vocab picks the same); map it to the target vocab (+ d2t) and chain it as prev. Same signature as the
Triton kernel in markov_walk.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def markov_walk_ref(values: Tensor, cand: Tensor, w2_rows: Tensor, w1: Tensor, anchor: Tensor, scale: float,
                    d2t: Tensor | None = None, conf_base: Tensor | None = None, conf_w: Tensor | None = None,
                    noise: Tensor | None = None, temperature: Tensor | None = None,
                    sampled: Tensor | None = None, allow: Callable[[int, Tensor], Tensor | None] | None = None
                    ) -> tuple[Tensor, Tensor, Tensor | None]:
    """values [R, N, K] fp32 base logits of the candidates (times logit_scale); cand [R, N, K] int64 draft ids;
    w2_rows [R, N, K, r] their W2 rows; w1 [V_in, r] (indexed by target ids); anchor [R] int64 target ids;
    d2t [V_draft] int64 offsets (None: identity); conf_base [R, N] fp32 confidence logits without the Markov
    term and conf_w [r] its weights on W1[prev] (None: no confidence head, or one without W1[prev]);
    noise [R, N, K] fp32 Gumbel noise at the candidates, temperature [R] fp32 (> 0 on sampled rows), sampled
    [R] bool (noise None: every row greedy); allow(k, prev) (this reference only): [R, K] bool, the candidates step
    k may pick given the previous tokens prev [R] (target ids; the anchor at k = 0), or None: all of them.

    -> tokens [R, N] int64 target ids, logits [R, N, K] fp32 biased pre-temperature candidate logits (q is their
    softmax at T), confidence logits [R, N] fp32 (None without conf_base).
    """
    num, n, _ = values.shape
    prev, tokens, logits, conf = anchor.long(), [], [], []
    for k in range(n):
        e = w1[prev].float()  # [R, r]
        lg = values[:, k].float() + scale * torch.einsum("bkr,br->bk", w2_rows[:, k].float(), e)  # [R, K]
        ok = allow(k, prev) if allow is not None else None
        if ok is not None:
            lg = lg.masked_fill(~ok, float("-inf"))
        sel = lg
        if noise is not None:
            sel = torch.where(sampled[:, None], lg / temperature[:, None] + noise[:, k], lg)
        best = sel.max(-1, keepdim=True).values
        big = torch.iinfo(torch.int64).max
        draft = torch.where(sel == best, cand[:, k], big).min(-1).values  # [R] draft ids, ties to the smallest
        prev = draft + d2t[draft] if d2t is not None else draft
        tokens.append(prev)
        logits.append(lg)
        if conf_base is not None:
            conf.append(conf_base[:, k] + (e @ conf_w.float() if conf_w is not None else 0.0))
    return torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(conf, 1) if conf_base is not None else None
