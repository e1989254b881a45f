"""The target on its device: prepared once (fused layers on CUDA), then its forward and logits on the Triton fast
path, or the model's own forward where the fast path does not run (CPU, autograd, `triton: false`)."""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.kernels.config import HAVE_TRITON, KernelConfig, active, use_triton
from dspark_serve.models.qwen import QwenForCausalLM

from .fused_layers import FusedLayer, fuse_layers, run_fused_layers


def takes_fast_path(device: torch.device, kernels: KernelConfig) -> bool:
    """Whether inference on `device` runs the Triton kernels (then the layers are fused when prepared)."""
    return HAVE_TRITON and kernels.triton is not False and (device.type == "cuda" or kernels.triton is True)


class TargetRunner:
    def __init__(self, model: QwenForCausalLM, kernels: KernelConfig | None = None) -> None:
        self.model, self.kernels = model, kernels or active()
        self.device = model.lm_head.weight.device
        self.layers: list[FusedLayer] | None = fuse_layers(model.model.layers, self.kernels) \
            if takes_fast_path(self.device, self.kernels) else None

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
        """QwenForCausalLM.forward: input_ids, positions [T] -> (final-normed hidden [T, hidden], captured
        [T, len(capture) * hidden] | None)."""
        m = self.model.model
        if self.layers is None or not use_triton(m.embed_tokens.weight, self.kernels):
            return self.model(input_ids, positions, meta, kv_cache, capture_layers)
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary.cos_sin(positions, x.dtype)
        want: dict[int, Tensor | None] = {i: None for i in capture_layers}
        if -1 in want:  # DeepSpec's -1: the embedding output
            want[-1] = x
        hidden = run_fused_layers(self.layers, x, cos, sin, kv_cache, meta, m.norm, want)
        captured = torch.cat([want[i] for i in capture_layers], dim=-1) if capture_layers else None
        return hidden, captured

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[T, hidden] -> [T, vocab] fp32; on CUDA with KernelConfig.lm_head_gemv, decode rows through the GEMVs."""
        if self.kernels.lm_head_gemv and hidden.is_cuda:
            from dspark_serve.kernels.gemv_bf16 import linear
            return linear(hidden, self.model.lm_head.weight).float()
        return self.model.compute_logits(hidden)
