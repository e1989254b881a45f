"""How many drafts each request verifies this step: its own cap and remaining tokens, the confidence and survival
thresholds, the stale survival budget and the per-step token cap (dspark_* fields of SpeculativeConfig)."""

from __future__ import annotations

import torch
from torch import Tensor

from .drafter import DraftProposal
from .request import Request
from .spec_config import SpeculativeConfig


def num_to_verify(reqs: list[Request], proposal: DraftProposal | None, spec: SpeculativeConfig,
                  max_drafts: int, remaining: list[int] | None = None) -> list[int]:
    """Drafts verified per request; each cut depends only on what is known before that draft is drawn.

    c_k = sigmoid(confidence logit k) depends on h_k and the previous draft only, so a rule on c_0..c_k decides on
    draft k without looking at it. Confidence threshold t: the drafts before the first k with c_k < t (DeepSpec's
    rule). Survival threshold s: the drafts with prod_{i<=k} c_i >= s. Budget: the capacity comes from the previous
    step's survival (stale). Token cap: the step verifies at most dspark_max_verify_tokens drafts, the most likely
    to survive first.
    """
    n = wanted(reqs, max_drafts, remaining)
    cap = spec.dspark_max_verify_tokens
    has_conf = proposal is not None and proposal.confidence_logits is not None
    if not has_conf or not reads_confidences(reqs, spec, n):
        return _cap_tokens(n, None, cap) if 0 < cap < sum(n) else n  # no device -> host read of the confidences
    conf = torch.sigmoid(proposal.confidence_logits.float()).cpu()  # [R, N] c_k
    survival = conf.cumprod(-1)  # [R, N] prod_{i<=k} c_i, non-increasing along k
    thresholds = _thresholds(reqs, spec)
    if any(t > 0 for t in thresholds):
        n = [min(a, b) for a, b in zip(n, confident_prefix(conf, torch.tensor(thresholds)).tolist())]
    if spec.dspark_survival_threshold > 0:
        n = [min(a, b) for a, b in zip(n, (survival >= spec.dspark_survival_threshold).sum(-1).tolist())]
    if spec.dspark_budget_frac > 0:
        n = [min(a, b) for a, b in zip(n, _budget_capacity(reqs, spec.dspark_budget_frac, max_drafts))]
    for r, s in zip(reqs, survival):
        r.last_survival = s
    return _cap_tokens(n, survival, cap) if 0 < cap < sum(n) else n


def confident_prefix(conf: Tensor, thresholds: Tensor) -> Tensor:
    """conf [R, N] c_k, thresholds [R] -> [R] int64: the index of the first c_k < t, or N when there is none
    (t <= 0 keeps every draft, as c_k >= 0)."""
    return (conf >= thresholds[:, None].to(conf.dtype)).long().cumprod(-1).sum(-1)


def wanted(reqs: list[Request], max_drafts: int, remaining: list[int] | None = None) -> list[int]:
    """Drafts each request can use: its own cap, the draft's block, and its remaining tokens minus the bonus."""
    remaining = [r.remaining for r in reqs] if remaining is None else remaining
    return [max(0, min(r.num_speculative_tokens, max_drafts, left - 1)) for r, left in zip(reqs, remaining)]


def _thresholds(reqs: list[Request], spec: SpeculativeConfig) -> list[float]:
    return [spec.dspark_confidence_threshold if r.confidence_threshold is None else r.confidence_threshold
            for r in reqs]


def reads_confidences(reqs: list[Request], spec: SpeculativeConfig, n: list[int]) -> bool:
    """Whether num_to_verify reads this step's confidences to the host (a sync on the draft)."""
    return spec.dspark_budget_frac > 0 or spec.dspark_survival_threshold > 0 \
        or any(t > 0 for t in _thresholds(reqs, spec)) or 0 < spec.dspark_max_verify_tokens < sum(n)


def _cap_tokens(n: list[int], survival: Tensor | None, cap: int) -> list[int]:
    """Keep the `cap` slots (request r, draft k < n[r]) ranked by survival [R, N] (or by k without it); ties go to
    the earlier draft, so a slot's fate depends on its own prefix and other requests only: each row keeps a prefix."""
    s = survival.tolist() if survival is not None else None
    slots = [(-(s[r][k] if s is not None else 0.0), k, r) for r, m in enumerate(n) for k in range(m)]
    keep = [0] * len(n)
    for _, _, r in sorted(slots)[:cap]:
        keep[r] += 1
    return keep


def _budget_capacity(reqs: list[Request], frac: float, max_drafts: int) -> list[int]:
    known = [r.last_survival for r in reqs if r.last_survival is not None]
    if not known:
        return [max_drafts] * len(reqs)
    budget = int(len(reqs) * max_drafts * frac) + 1
    flat = torch.cat([s if s is not None else torch.ones(max_drafts) for s in (r.last_survival for r in reqs)])
    owner = torch.arange(len(reqs)).repeat_interleave(max_drafts)
    top = flat.topk(min(budget, flat.numel())).indices
    return torch.bincount(owner[top], minlength=len(reqs)).tolist()
