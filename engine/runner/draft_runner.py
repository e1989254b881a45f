"""The draft on its device: prepared once (the 4-bit copy of its lm_head, fused layers, dense copies of small NVFP4
layers, bf16 block scales, all layers' k/v projections as one weight), then its context write and block pass on
the Triton fast path, or on the reference modules where it does not run."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_serve.kernels.attention import AttentionMetadata, store_kv
from dspark_serve.kernels.config import KernelConfig, active, use_triton
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.layers import Rotary
from dspark_serve.models.nvfp4_linear import NVFP4Linear

from .fused_layers import FusedLayer, fuse_layers, fused_stack
from .target_runner import takes_fast_path

DENSE_NVFP4_MAX_BYTES = 512 << 20  # NVFP4 drafts whose bf16 copies fit keep them (NVFP4Linear.keep_dense) ...
DENSE_NVFP4_MAX_FRACTION = 0.02  # ... or fit in this share of the GPU's memory (an 8B draft's 1.2 GB on an H200)
DENSE_NVFP4_MIN_ROWS = 17  # ... and use them from this many rows on (measured: the GEMV wins at the draft's 7)


def quantizes_lm_head(model: DSparkDraft, requested: bool) -> bool:
    """Whether the draft's bf16 lm_head (usually the target's, shared) gets a 4-bit copy for drafting."""
    head = model.lm_head
    return requested and type(head) is nn.Linear and head.in_features % 16 == 0


def keep_dense_up_to(modules: Iterable[nn.Module], max_bytes: int, min_rows: int = DENSE_NVFP4_MIN_ROWS) -> int:
    """keep_dense(min_rows=min_rows) on every NVFP4Linear among `modules` without a dense weight yet (see
    use_source_from) when their bf16 copies fit in `max_bytes` together (a small draft then runs at bf16 speed from
    min_rows rows on); -> the bytes kept (0 when they do not fit)."""
    layers = [m for m in modules if isinstance(m, NVFP4Linear) and getattr(m, "_dense", None) is None]
    need = sum(2 * m.in_features * m.out_features for m in layers)
    if not layers or need > max_bytes:
        return 0
    for m in layers:
        m.keep_dense(min_rows=min_rows)
    return need


class DraftRunner:
    def __init__(self, model: DSparkDraft, kernels: KernelConfig | None = None,
                 quantize_lm_head: bool = False) -> None:
        self.model, self.kernels = model, kernels or active()
        self.device = model.fc.weight.device
        if quantizes_lm_head(model, quantize_lm_head):
            head = model.lm_head
            model.lm_head = NVFP4Linear.from_linear(head)
            model.lm_head.use_source_from(head.weight, DENSE_NVFP4_MIN_ROWS)
        self.layers: list[FusedLayer] | None = None
        if takes_fast_path(self.device, self.kernels):
            self.layers = fuse_layers(model.layers, self.kernels)
        self.stack = fused_stack(self.layers) if self.layers is not None else None  # the model's layers, fused
        if self.device.type == "cuda":
            budget = max(DENSE_NVFP4_MAX_BYTES,
                         int(DENSE_NVFP4_MAX_FRACTION * torch.cuda.get_device_properties(self.device).total_memory))
            keep_dense_up_to(model.modules(), budget)
            if self.kernels.gemv_prmt:  # the GEMV's inline-PTX decode reads bf16 block scales
                for mod in model.modules():
                    if isinstance(mod, NVFP4Linear):
                        mod.keep_bf16_scales()
        self.kv_weight, self.kv_bias = self._stacked_kv()

    def _stacked_kv(self) -> tuple[Tensor, Tensor | None]:
        """[num_layers * 2 * kv_size, hidden]: per layer its k then v rows (NVFP4 ones dequantized once)."""
        attns = [layer.self_attn for layer in self.model.layers]
        dt = self.model.hidden_norm.weight.dtype
        dense = [p.weight if isinstance(p, nn.Linear) else p.dequantized_weight(dt)
                 for a in attns for p in (a.k_proj, a.v_proj)]
        bias = torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)]).detach() \
            if attns[0].k_proj.bias is not None else None
        return torch.cat(dense).detach(), bias

    def write_context(self, features: Tensor, positions: Tensor, slot_mapping: Tensor, kv_cache: Tensor,
                      all_slots_valid: bool = False) -> None:
        """DSparkDraft.write_context with one GEMM over all layers' stacked [Wk; Wv], then each layer's k_norm, RoPE
        and cache write (one Triton launch per layer on the fast path; it skips negative slots)."""
        m = self.model
        hn = m.hidden_norm
        fc = m.fc(features.to(hn.weight.dtype))
        fast = self.layers is not None and use_triton(fc, self.kernels)
        if fast:
            from dspark_serve.kernels.fused_ops import qk_norm_rotary, rms_norm
        ctx = rms_norm(fc, hn.weight, hn.eps) if fast else hn(fc)  # [T, hidden]
        cos, sin = m.rotary.cos_sin(positions, ctx.dtype)
        c = m.config.layers
        kv = F.linear(ctx, self.kv_weight, self.kv_bias).view(ctx.shape[0], len(m.layers), 2, c.num_kv_heads,
                                                              c.head_dim)
        for i, layer in enumerate(m.layers):
            norm, k, v = layer.self_attn.k_norm, kv[:, i, 0], kv[:, i, 1]  # [T, KV, D]
            if fast:  # no query heads: the kernel's k half only, written to the cache with v in the same launch
                kw = norm.weight if norm is not None else None
                qk_norm_rotary(k[:, :0], k, cos, sin, kw, kw, norm.eps if norm is not None else 0.0,
                               (v, kv_cache[i, 0], kv_cache[i, 1], slot_mapping))
            else:
                k = Rotary.apply(norm(k) if norm is not None else k, cos, sin)
                store_kv(k, v, kv_cache[i, 0], kv_cache[i, 1], slot_mapping, all_slots_valid)

    def block_hidden(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor) -> Tensor:
        """DSparkDraft.block_hidden: query block tokens [R * Q] (non-causal `meta`) -> final-normed hidden."""
        m = self.model
        fast = self.stack is not None and use_triton(m.embed_tokens.weight, self.kernels)
        return m.block_hidden(input_ids, positions, meta, kv_cache, self.stack if fast else None)
