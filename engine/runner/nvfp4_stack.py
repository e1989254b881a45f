"""NVFP4 layers that share an input, stacked into one 4-bit weight for the mma GEMV."""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_serve.models.nvfp4_linear import NVFP4Linear
from .views import concat_as_views


class NVFP4Stack:
    """NVFP4 layers sharing an input (q/k/v, gate/up) as one [sum N, K] weight for the mma GEMV, which scales each
    output row by its own layer's weight_scale_2; their buffers become views into the stack. Other shapes (one
    row, more than 16, CPU) run the layers one by one and concatenate."""

    def __init__(self, layers: list[NVFP4Linear]) -> None:
        k = layers[0].in_features
        if any(m.in_features != k for m in layers):
            raise ValueError(f"stacked NVFP4 layers need one in_features, got {[m.in_features for m in layers]}")
        if len({m.bias is None for m in layers}) > 1:  # checked before any buffer is re-pointed
            raise ValueError("stacked NVFP4 layers need a bias on all of them or on none")
        self.layers = layers  # they stay where they are in the model (a plain object: nothing is registered twice)
        self.out_features = sum(m.out_features for m in layers)
        self.weight = concat_as_views([m.weight for m in layers])
        self.weight_scale = concat_as_views([m.weight_scale for m in layers])
        self.row_scale = torch.cat([m.weight_scale_2.float().expand(m.out_features) for m in layers])
        self.bias = torch.cat([m.bias.detach() for m in layers]) if layers[0].bias is not None else None

    def __call__(self, x: Tensor) -> Tensor:  # [T, K] -> [T, sum N]
        out = None
        if x.is_cuda:
            from dspark_serve.kernels.w4a16_gemv import stacked_gemv
            out = stacked_gemv(x, self.weight, self.weight_scale, self.row_scale)
        if out is None:
            return torch.cat([layer(x) for layer in self.layers], -1)
        return out if self.bias is None else out + self.bias

