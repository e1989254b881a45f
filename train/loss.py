"""DeepSpec's DSpark loss (dspark.md 7.1): decayed CE + L1 distillation + confidence BCE, as a pure function."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_serve.kernels.config import HAVE_TRITON
from dspark_serve.kernels.distill_loss_ref import distill_rows_ref

LOSS_WEIGHTS = (0.1, 0.9, 1.0)  # (ce, tv, conf)


@dataclass(frozen=True)
class LossParts:
    total: Tensor  # scalar, what is backpropagated
    ce: Tensor
    tv: Tensor  # mean L1 distance (= 2 TV)
    conf: Tensor  # 0 when the draft has no confidence head
    accuracy: Tensor  # weighted top-1 agreement with the labels (a metric, no grad)
    weight: Tensor  # sum of the position weights (the denominator)


def position_weights(eval_mask: Tensor, gamma: float = 4.0) -> Tensor:
    """eval_mask [N, B] -> w [N, B] = exp(-k / gamma) * eval_mask, k 0-based."""
    k = torch.arange(eval_mask.shape[-1], device=eval_mask.device, dtype=torch.float32)
    return torch.exp(-k / gamma) * eval_mask.float()


def distill_rows(z: Tensor, t: Tensor, target_row: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The fused Triton kernel on CUDA, the reference elsewhere (kernels/distill_loss*.py)."""
    if z.is_cuda and HAVE_TRITON:
        from dspark_serve.kernels.distill_loss import distill_rows as fused
        return fused(z, t, target_row, labels)
    return distill_rows_ref(z, t, target_row, labels)


def dspark_loss(draft_logits: Tensor, target_logits: Tensor, labels: Tensor, eval_mask: Tensor,
                conf_logits: Tensor | None = None, gamma: float = 4.0,
                weights: tuple[float, float, float] = LOSS_WEIGHTS, target_index: Tensor | None = None) -> LossParts:
    """draft logits [N, B, V], labels and eval_mask [N, B], confidence logits [N, B] -> LossParts. Target logits
    are [N, B, V], or [U, V] rows picked by target_index [N, B] (each target position's logits once)."""
    n, b, v = draft_logits.shape
    w = position_weights(eval_mask, gamma)  # [N, B]
    denom = w.sum().clamp(min=1e-6)
    if target_index is None:
        target_logits, target_index = target_logits.reshape(n * b, v), torch.arange(n * b, device=w.device)
    ce, l1, top = distill_rows(draft_logits.reshape(n * b, v), target_logits, target_index.reshape(-1),
                               labels.reshape(-1).clamp(min=0))
    ce, l1 = ce.view_as(w), l1.view_as(w)  # [N, B]
    l_ce, l_tv = (w * ce).sum() / denom, (w * l1).sum() / denom
    l_conf = torch.zeros((), device=w.device)
    if conf_logits is not None:
        c_star = (1 - l1.detach() / 2).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        l_conf = (w * bce).sum() / denom
    total = weights[0] * l_ce + weights[1] * l_tv + weights[2] * l_conf
    acc = (w * (top.view_as(labels) == labels).float()).sum() / denom
    return LossParts(total=total, ce=l_ce, tv=l_tv, conf=l_conf, accuracy=acc, weight=w.sum())
