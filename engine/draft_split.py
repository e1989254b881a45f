"""How a step's budget of verified drafts is split across its rows: by rank of survival, every row a prefix. A pure
function of device tensors (no host sync, CUDA-graph capturable); the policy that sizes the budget is
engine/core/policy.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_COND = 0.995  # a corrected conditional confidence never reaches 1


def split_budget(conf: Tensor | None, ratios: Tensor, caps: Tensor, pinned: Tensor, budget: Tensor,
                 thresholds: Tensor | None = None, survival_floor: float = 0.0) -> Tensor:
    """Drafts each row verifies -> n [R] int64; every tensor on one device, no host sync (capturable).

    conf [R, N] the drafter's c_k (None without a confidence head), ratios [R, N] the online correction (without a
    head: the conditional acceptance estimates), caps [R] int64, pinned [R] bool (a pinned row's capped slots come
    first), budget [] int64 slots in all, thresholds [R] (verify the drafts before the first c_k below it; 0 = off),
    survival_floor (slots below it are never verified). Slot (r, k) ranks by its survival; ties go to the earlier
    position, then the lower row, so every row keeps a prefix."""
    num_reqs, n = ratios.shape
    c = (conf.float() * ratios if conf is not None else ratios).clamp(0.0, MAX_COND)  # [R, N]
    survival = c.cumprod(-1)  # [R, N], non-increasing along k
    k = torch.arange(n, device=ratios.device)
    ok = k[None, :] < caps[:, None]  # [R, N]
    if thresholds is not None and conf is not None:
        ok &= (conf.float() >= thresholds[:, None]).long().cumprod(-1).bool()
    if survival_floor > 0 and conf is not None:  # the threshold rules read the drafter's own c_k
        ok &= conf.float().cumprod(-1) >= survival_floor
    score = torch.where(ok, torch.where(pinned[:, None], 2.0, survival), -1.0)  # [R, N]
    flat = score.t().reshape(-1)  # k-major: slot (r, k) at k * R + r
    order = torch.argsort(flat, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    chosen = (rank < budget) & (flat >= 0)
    return chosen.view(n, num_reqs).sum(0)


@dataclass(frozen=True)
class DraftSlots:
    """What bounds the drafts each row of a step verifies: its cap, whether it is pinned, the step's budget, and
    the split's inputs (the policy's corrections, the confidence thresholds, the survival floor)."""

    caps: list[int]
    pinned: list[bool]
    budget: int
    ratios: list[list[float]]  # [R][N]
    thresholds: list[float]  # [R]
    survival_floor: float = 0.0

    @property
    def binds(self) -> bool:
        """Whether the split must read the confidences: the budget binds, or a threshold rule is on."""
        return self.budget < sum(self.caps) or self.survival_floor > 0 or any(t > 0 for t in self.thresholds)

    def known_lengths(self) -> list[int] | None:
        """The drafts each row verifies when they follow without the confidences (else None)."""
        if self.budget <= 0 or not any(self.caps):
            return [0] * len(self.caps)
        if not self.binds:
            return list(self.caps)
        if len(self.caps) == 1 and self.survival_floor <= 0 and self.thresholds[0] <= 0:
            return [min(self.caps[0], self.budget)]
        return None

    def split_on_host(self, conf: Tensor | None) -> list[int]:
        """split_budget on the host (conf [R, N] read there: a sync when it lives on a GPU)."""
        if self.budget <= 0 or not any(self.caps):
            return [0] * len(self.caps)
        if not self.binds:
            return list(self.caps)
        conf = conf.float().cpu() if conf is not None else None
        return split_budget(conf, torch.tensor(self.ratios, dtype=torch.float32), torch.tensor(self.caps),
                            torch.tensor(self.pinned), torch.tensor(self.budget), torch.tensor(self.thresholds),
                            self.survival_floor).tolist()
