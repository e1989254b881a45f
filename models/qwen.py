"""Qwen3 / Qwen2 (Qwen2.5) causal LM over a paged KV cache: prefill, decode and multi-token verify in one forward."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from dspark_serve.kernels.attention import AttentionMetadata, paged_attention, store_kv

from .config import ModelConfig
from .layers import MLP, AttentionProjections, RMSNorm, Rotary


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = AttentionProjections(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        """x [T, hidden]; kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.query(h, cos, sin)
        k, v = attn.key_value(h, cos, sin)
        store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, meta.all_slots_valid)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, attn.scale)  # [T, H, D]
        x = x + attn.o_proj(o.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


def run_layers(layers: nn.ModuleList, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
               final_norm: RMSNorm, want: dict[int, Tensor | None]) -> Tensor:
    """The decoder stack -> final-normed hidden; fills want[i] with layer i's residual output. A runner may pass
    the models another function of this signature (the same stack on other kernels)."""
    for i, layer in enumerate(layers):
        x = layer(x, cos, sin, kv_cache[i], meta)
        if i in want:
            want[i] = x
    return final_norm(x)


LayerStack = Callable[[nn.ModuleList, Tensor, Tensor, Tensor, Tensor, AttentionMetadata, RMSNorm,
                       dict[int, "Tensor | None"]], Tensor]  # run_layers' signature


class QwenModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)


class QwenForCausalLM(nn.Module):
    """Module names match HF's Qwen3ForCausalLM / Qwen2ForCausalLM, so checkpoint keys map 1:1."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = QwenModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                          device: torch.device | str | None = None) -> Tensor:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zero-filled."""
        c = self.config
        ref = self.lm_head.weight
        return torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                           dtype=dtype or ref.dtype, device=device or ref.device)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor,
                capture_layers: tuple[int, ...] = (), stack: LayerStack | None = None) -> tuple[Tensor, Tensor | None]:
        """input_ids, positions [T] -> (final-normed hidden [T, hidden], captured [T, len(capture) * hidden] | None).

        A captured id i is the raw residual output of decoder layer i (HF `hidden_states[i + 1]`). `stack` runs the
        decoder layers (default: run_layers, the modules' own forwards).
        """
        m = self.model
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary.cos_sin(positions, x.dtype)
        want: dict[int, Tensor | None] = {i: None for i in capture_layers}
        if -1 in want:  # DeepSpec's -1: the embedding output
            want[-1] = x
        hidden = (stack or run_layers)(m.layers, x, cos, sin, kv_cache, meta, m.norm, want)
        captured = torch.cat([want[i] for i in capture_layers], dim=-1) if capture_layers else None
        return hidden, captured

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[T, hidden] -> [T, vocab] fp32."""
        return self.lm_head(hidden).float()
