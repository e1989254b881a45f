"""The target on its device: prepared once (fused layers on CUDA), then its forward and logits on the Triton fast
path, or the model's own forward where the fast path does not run (CPU, autograd, `triton: false`). In the
deterministic mode the fast path's layers are the batch-invariant ones (fused_layers.py) and the lm_head is the
invariant matmul; without the fast path, the model's own forward one row at a time (row_order.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.kernels.config import HAVE_TRITON, KernelConfig, active, use_triton
from dspark_serve.models.qwen import QwenForCausalLM

from .fused_layers import FusedLayer, fuse_layers, fused_stack
from .row_order import forward_by_row, logits_by_row


def takes_fast_path(device: torch.device, kernels: KernelConfig) -> bool:
    """Whether inference on `device` runs the Triton kernels (then the layers are fused when prepared)."""
    return HAVE_TRITON and kernels.triton is not False and (device.type == "cuda" or kernels.triton is True)


class TargetRunner:
    def __init__(self, model: QwenForCausalLM, kernels: KernelConfig | None = None,
                 deterministic: bool = False) -> None:
        self.model, self.kernels, self.deterministic = model, kernels or active(), deterministic
        self.device = model.lm_head.weight.device
        fast = takes_fast_path(self.device, self.kernels)
        self.invariant = deterministic and fast  # batch-invariant kernels, graphs as the default mode
        self.row_order = deterministic and not fast  # one eager forward a row
        self.layers: list[FusedLayer] | None = fuse_layers(model.model.layers, self.kernels, self.invariant) \
            if fast else None
        self.stack = fused_stack(self.layers) if self.layers is not None else None  # the model's layers, fused

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
        """QwenForCausalLM.forward: input_ids, positions [T] -> (final-normed hidden [T, hidden], captured
        [T, len(capture) * hidden] | None)."""
        if self.row_order:
            return forward_by_row(self.model, input_ids, positions, meta, kv_cache, capture_layers)
        fast = self.stack is not None and (self.invariant or use_triton(self.model.model.embed_tokens.weight,
                                                                          self.kernels))
        return self.model(input_ids, positions, meta, kv_cache, capture_layers, self.stack if fast else None)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[T, hidden] -> [T, vocab] fp32; on CUDA with KernelConfig.lm_head_gemv, decode rows through the GEMVs;
        deterministic: each row's product as it would be alone."""
        if self.row_order:
            return logits_by_row(self.model, hidden)
        if self.invariant:
            from dspark_serve.kernels.matmul_invariant import matmul_invariant
            return matmul_invariant(hidden, self.model.lm_head.weight, self.model.lm_head.bias, torch.float32)
        if self.kernels.lm_head_gemv and hidden.is_cuda:
            from dspark_serve.kernels.gemv_bf16 import linear
            return linear(hidden, self.model.lm_head.weight).float()
        return self.model.compute_logits(hidden)
