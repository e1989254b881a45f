"""Per-row distillation terms of DSpark's training loss (dspark.md 7.1), plain PyTorch: the reference of
distill_loss.py (same signature). Differentiable through autograd in the draft logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def distill_rows_ref(draft_logits: Tensor, target_logits: Tensor, target_row: Tensor,
                     labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """draft logits z [R, V], target logits t [U, V] (no grad), target_row [R] (row of t for each row of z),
    labels [R] in [0, V) -> (ce [R] = -log softmax(z)[label], l1 [R] = sum |softmax(z) - softmax(t[target_row])|,
    argmax [R] int64 of z, first index on ties), fp32."""
    z = draft_logits.float()
    q = target_logits.float()[target_row].softmax(-1)
    ce = F.cross_entropy(z, labels, reduction="none")
    l1 = (z.softmax(-1) - q).abs().sum(-1)
    return ce, l1, z.detach().argmax(-1)
