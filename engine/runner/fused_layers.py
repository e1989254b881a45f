"""A decoder layer prepared for inference: q/k/v and gate/up as one weight each (views of the module's own
parameters, or one NVFP4Stack for 4-bit ones), tile-major copies for 2-16-row GEMVs, and its forward on the Triton
kernels (norms fused with the residual add and into the one-row GEMVs, q/k norm + RoPE + K/V store in one launch,
Triton paged attention). The plain modules (models/layers.py, models/qwen.py) are the reference it equals.

Batch-invariant layers (the deterministic mode on the fast path) take one tile shape whatever the rows: every
projection through kernels/matmul_invariant.py after a separate per-row RMSNorm, attention through the paged kernel
with one fixed config and no key split, so a row's bits do not depend on its batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dspark_serve.kernels.attention import AttentionMetadata, prompt_attention
from dspark_serve.kernels.config import KernelConfig, active
from dspark_serve.models.layers import MLP, AttentionProjections, RMSNorm
from dspark_serve.models.nvfp4_linear import NVFP4Linear
from dspark_serve.models.qwen import DecoderLayer, LayerStack
from .views import concat_as_views

from .nvfp4_stack import NVFP4Stack

if TYPE_CHECKING:
    from dspark_serve.kernels.gemv_bf16 import Norm

MAX_TRITON_QUERY = 16  # fresh prompts longer than this attend with one SDPA, the rest with the paged kernel
NOT_INVARIANT = "the deterministic mode takes a target with bf16 / fp32 projections (its batch-invariant layers)"


def _invariant_attention():
    from dspark_serve.kernels.paged_attention_triton import AttentionConfig
    return AttentionConfig(block_m=64, block_n=32, num_splits=1)  # every query and context: one tile walk a row


def matmul_invariant(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    from dspark_serve.kernels.matmul_invariant import matmul_invariant as mm
    return mm(x, w, bias)


@dataclass
class FusedMLP:
    mlp: MLP
    gate_up: Tensor | None = None  # [2I, hidden]: gate's and up's weights are views of it
    gate_up_q4: NVFP4Stack | None = None  # NVFP4 gate and up as one stack
    tiled: tuple[Tensor | None, Tensor | None] = (None, None)  # tile-major gate/up and down
    invariant: bool = False  # batch-invariant (module docstring)

    @classmethod
    def of(cls, mlp: MLP, tiled: bool, invariant: bool = False) -> FusedMLP:
        if type(mlp.gate_proj) is nn.Linear and type(mlp.up_proj) is nn.Linear:
            gate_up = concat_as_views([mlp.gate_proj.weight, mlp.up_proj.weight])
            down = mlp.down_proj.weight if type(mlp.down_proj) is nn.Linear else None
            if invariant and down is None:
                raise ValueError(NOT_INVARIANT)
            copies = (tiled_copy(gate_up, swiglu=True), tiled_copy(down)) if tiled else (None, None)
            return cls(mlp, gate_up=gate_up, tiled=copies, invariant=invariant)
        if invariant:
            raise ValueError(NOT_INVARIANT)
        if _all_nvfp4(mlp.gate_proj, mlp.up_proj):
            return cls(mlp, gate_up_q4=NVFP4Stack([mlp.gate_proj, mlp.up_proj]))
        return cls(mlp)

    def forward(self, x: Tensor) -> Tensor:
        """MLP.forward with one gate/up GEMM and the Triton silu*mul (one row: in the GEMV's epilogue)."""
        from dspark_serve.kernels.fused_ops import silu_mul
        from dspark_serve.kernels.gemv_bf16 import linear_silu_mul

        if self.invariant:
            return self._down(silu_mul(matmul_invariant(x, self.gate_up)))
        if self.gate_up is not None:
            return self._down(linear_silu_mul(x, self.gate_up, self.tiled[0]))
        m = self.mlp
        gate_up = self.gate_up_q4(x) if self.gate_up_q4 is not None else torch.cat((m.gate_proj(x), m.up_proj(x)), -1)
        return self._down(silu_mul(gate_up))  # [T, I]

    def forward_normed(self, x: Tensor, norm: Norm) -> tuple[Tensor, Tensor]:
        """forward(RMSNorm(x [+ residual])) and the new residual; the one-row gate/up GEMV applies the norm itself."""
        from dspark_serve.kernels.gemv_bf16 import apply_norm, norm_linear_silu_mul

        if self.gate_up is not None and not self.invariant:
            h, residual = norm_linear_silu_mul(x, norm, self.gate_up, self.tiled[0])
            return self._down(h), residual
        h, residual = apply_norm(x, norm)
        return self.forward(h), residual

    def _down(self, h: Tensor) -> Tensor:
        from dspark_serve.kernels.gemv_bf16 import linear

        down = self.mlp.down_proj
        if self.invariant:
            return matmul_invariant(h, down.weight, down.bias)
        return linear(h, down.weight, down.bias, self.tiled[1]) if type(down) is nn.Linear else down(h)


@dataclass
class FusedAttention:
    attn: AttentionProjections
    qkv: tuple[Tensor, Tensor | None] | None = None  # [q + 2 kv, hidden] and its bias: q/k/v's are views of them
    qkv_q4: NVFP4Stack | None = None  # NVFP4 q/k/v as one stack
    tiled: tuple[Tensor | None, Tensor | None] = (None, None)  # tile-major qkv and o
    invariant: bool = False  # batch-invariant (module docstring)

    @classmethod
    def of(cls, attn: AttentionProjections, tiled: bool, invariant: bool = False) -> FusedAttention:
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        if all(type(p) is nn.Linear for p in projs) and (type(attn.o_proj) is nn.Linear or not invariant):
            bias = concat_as_views([p.bias for p in projs]) if attn.q_proj.bias is not None else None
            qkv = (concat_as_views([p.weight for p in projs]), bias)
            o = attn.o_proj.weight if type(attn.o_proj) is nn.Linear else None
            return cls(attn, qkv=qkv, tiled=(tiled_copy(qkv[0]), tiled_copy(o)) if tiled else (None, None),
                       invariant=invariant)
        if invariant:
            raise ValueError(NOT_INVARIANT)
        if _all_nvfp4(*projs):
            return cls(attn, qkv_q4=NVFP4Stack(list(projs)))
        return cls(attn)

    def query_key_value(self, x: Tensor, norm: Norm, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                        slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
        """The attention's q, k, v of RMSNorm(x [+ residual]) with one GEMM (the one-row GEMV applies the norm
        itself) and one Triton launch for the q/k norms, RoPE and the k/v write into the cache slots
        -> (q [T, H, D], the new residual)."""
        from dspark_serve.kernels.fused_ops import qk_norm_rotary
        from dspark_serve.kernels.gemv_bf16 import apply_norm, norm_linear

        a = self.attn
        t, d, h, kv = x.shape[0], a.head_dim, a.num_heads, a.num_kv_heads
        if self.invariant:
            x, residual = apply_norm(x, norm)
            qkv = matmul_invariant(x, *self.qkv)
        elif self.qkv is not None:
            qkv, residual = norm_linear(x, norm, *self.qkv, self.tiled[0])  # [T, (H + 2 KV) * D]
        else:
            x, residual = apply_norm(x, norm)
            qkv = self.qkv_q4(x) if self.qkv_q4 is not None else \
                torch.cat((a.q_proj(x), a.k_proj(x), a.v_proj(x)), -1)
        q = qkv[:, :h * d].view(t, h, d)
        k = qkv[:, h * d:(h + kv) * d].view(t, kv, d)
        v = qkv[:, (h + kv) * d:].view(t, kv, d)
        qw = a.q_norm.weight if a.q_norm is not None else None
        kw = a.k_norm.weight if a.k_norm is not None else None
        eps = a.q_norm.eps if a.q_norm is not None else 0.0
        return qk_norm_rotary(q, k, cos, sin, qw, kw, eps, (v, k_cache, v_cache, slot_mapping))[0], residual

    def output(self, o: Tensor) -> Tensor:
        """o_proj of the attention output [T, H * D] through the dense GEMVs."""
        from dspark_serve.kernels.gemv_bf16 import linear

        p = self.attn.o_proj
        if self.invariant:
            return matmul_invariant(o, p.weight, p.bias)
        return linear(o, p.weight, p.bias, self.tiled[1]) if type(p) is nn.Linear else p(o)


@dataclass
class FusedLayer:
    layer: DecoderLayer
    attn: FusedAttention
    mlp: FusedMLP

    @classmethod
    def of(cls, layer: DecoderLayer, tiled: bool, invariant: bool = False) -> FusedLayer:
        return cls(layer, FusedAttention.of(layer.self_attn, tiled, invariant),
                   FusedMLP.of(layer.mlp, tiled, invariant))

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """DecoderLayer.forward with the residual adds fused into the norms: x is the previous layer's MLP output
        not yet added to `residual` (None before the first layer) -> (this layer's MLP output, its residual)."""
        ln = self.layer.input_layernorm
        q, residual = self.attn.query_key_value(x, (ln.weight, ln.eps, residual), cos, sin, kv_cache[0],
                                                kv_cache[1], meta.slot_mapping)  # k, v go to the cache
        o = attention(q, kv_cache[0], kv_cache[1], meta, self.attn.attn.scale, self.attn.invariant)  # [T, H, D]
        ln = self.layer.post_attention_layernorm
        return self.mlp.forward_normed(self.attn.output(o.reshape(x.shape[0], -1)), (ln.weight, ln.eps, residual))


def fuse_layers(layers: nn.ModuleList, kernels: KernelConfig, invariant: bool = False) -> list[FusedLayer]:
    """Every decoder layer prepared for the fast path (after the model is on its device), with tile-major copies
    where keep_tile_major says so; `invariant`: the batch-invariant layers (no copies)."""
    tiled = not invariant and keep_tile_major(layers, kernels)
    return [FusedLayer.of(layer, tiled, invariant) for layer in layers]


def run_fused_layers(layers: list[FusedLayer], x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                     meta: AttentionMetadata, final_norm: RMSNorm, want: dict[int, Tensor | None]) -> Tensor:
    """models/qwen.run_layers on the fused layers -> final-normed hidden; fills want[i] with layer i's residual
    output."""
    from dspark_serve.kernels.fused_ops import rms_norm

    residual = None
    for i, layer in enumerate(layers):
        x, residual = layer.forward(x, residual, cos, sin, kv_cache[i], meta)
        if i in want:
            want[i] = x + residual
    w, eps = final_norm.weight, final_norm.eps
    return rms_norm(x, w, eps) if residual is None else rms_norm(x, w, eps, residual)[0]


def fused_stack(layers: list[FusedLayer]) -> LayerStack:
    """A models/qwen.run_layers for the models' forwards that runs these fused layers in place of the modules
    handed to it (the same decoder layers, prepared)."""
    def stack(_modules: nn.ModuleList, *args) -> Tensor:
        return run_fused_layers(layers, *args)
    return stack


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
              invariant: bool = False) -> Tensor:
    """One SDPA over fresh prompts of more than 16 tokens (KernelConfig.prompt_sdpa); else the Triton paged
    attention: decode, verify and draft-block queries, and prompts after a cached start (over their cached keys).
    `invariant`: every query through the paged kernel with one config."""
    from dspark_serve.kernels.paged_attention_triton import paged_attention_triton

    if invariant:
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, _invariant_attention())
    if meta.max_query_len > MAX_TRITON_QUERY and meta.prompt_lens and active().prompt_sdpa:
        return prompt_attention(q, k_cache, v_cache, meta, scale)
    return paged_attention_triton(q, k_cache, v_cache, meta, scale)


def keep_tile_major(layers: nn.ModuleList, kernels: KernelConfig) -> bool:
    """Whether the fused layers keep tile-major copies of their bf16 projections: KernelConfig.dense_tiled, by
    default when the copies take at most its dense_tiled_max_fraction of the GPU's memory."""
    if kernels.dense_tiled is not None:
        return kernels.dense_tiled
    ws = [m.weight for m in layers.modules() if type(m) is nn.Linear and m.weight.is_cuda
          and m.weight.dtype == torch.bfloat16]
    return bool(ws) and sum(w.numel() * 2 for w in ws) <= \
        kernels.dense_tiled_max_fraction * torch.cuda.get_device_properties(ws[0].device).total_memory


def tiled_copy(w: Tensor | None, swiglu: bool = False) -> Tensor | None:
    """A tile-major copy of a bf16 weight on an sm_90 GPU that the mma GEMV can take (gemv_bf16_mma), for its
    2-16-row GEMVs; None otherwise (no memory spent where the kernel cannot run)."""
    if not (w is not None and w.is_cuda and w.dtype == torch.bfloat16 and w.dim() == 2
            and w.shape[0] % 16 == 0 and w.shape[1] % 128 == 0):
        return None
    from dspark_serve.kernels.gemv_bf16_mma import tile_major
    from dspark_serve.kernels.pdl import _sm90
    if not _sm90(w.device.index if w.device.index is not None else torch.cuda.current_device()):
        return None
    with torch.no_grad():
        return tile_major(w.detach(), swiglu)


def _all_nvfp4(*layers: nn.Module) -> bool:
    return all(isinstance(m, NVFP4Linear) for m in layers)
