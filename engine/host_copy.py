"""Copies between host and device that do not wait for the stream: a pageable copy to or from a GPU waits for the
work queued before it, a pinned one does not."""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list on `device`, without a stream sync."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def pinned_copy(x: Tensor) -> Tensor:
    """x copied to pinned host memory behind the work queued before it (without waiting for it)."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)
