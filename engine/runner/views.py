"""Fusing weights for inference without copies: tensors concatenated once, each re-pointed at its rows."""

from __future__ import annotations

import torch
from torch import Tensor


def concat_as_views(tensors: list[Tensor]) -> Tensor:
    """Concatenate parameters or buffers along dim 0 into one tensor and re-point each at its slice of it."""
    fused = torch.cat([t.detach() for t in tensors])
    start = 0
    for t in tensors:
        t.data = fused[start:start + t.shape[0]]
        start += t.shape[0]
    return fused
