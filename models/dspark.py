"""The DFlash backbone (target features injected as context K/V) with DSpark's Markov and confidence heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_serve.kernels.attention import AttentionMetadata, store_kv

from .draft_config import DraftConfig
from .layers import RMSNorm, Rotary
from .qwen import DecoderLayer, LayerStack, run_layers


class MarkovHead(nn.Module):
    """Vanilla Markov head: bias(prev) = W2 @ W1[prev]; W1 indexed by target ids, W2 rows are draft ids."""

    def __init__(self, input_vocab: int, draft_vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(input_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


class DSparkDraft(nn.Module):
    """Parameter names follow the DeepSpec checkpoint (no `model.` prefix)."""

    def __init__(self, cfg: DraftConfig, input_vocab: int | None = None) -> None:
        super().__init__()
        lc = cfg.layers
        self.config = cfg
        input_vocab = input_vocab or lc.vocab_size
        self.embed_tokens = nn.Embedding(input_vocab, lc.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(lc) for _ in range(lc.num_layers))  # non-causal via metadata
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.fc = nn.Linear(cfg.context_dim, lc.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.lm_head = nn.Linear(lc.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(lc.head_dim, lc.rope_theta)
        self.markov_head = MarkovHead(input_vocab, cfg.draft_vocab_size, cfg.markov_rank) if cfg.has_markov else None
        self.confidence_head = ConfidenceHead(cfg.confidence_in_features) if cfg.enable_confidence_head else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), persistent=False)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                          device: torch.device | str | None = None) -> Tensor:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
        c = self.config.layers
        ref = self.hidden_norm.weight  # not fc.weight: an NVFP4 fc stores packed uint8
        return torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                           dtype=dtype or ref.dtype, device=device or ref.device)

    def write_context(self, features: Tensor, positions: Tensor, slot_mapping: Tensor, kv_cache: Tensor,
                      all_slots_valid: bool = False) -> None:
        """Target features [T, len(target_layer_ids) * target_hidden] -> context K/V of every layer at `positions`:
        fc -> hidden_norm -> each layer's k/v projection, k_norm and RoPE -> the cache (no input_layernorm on the
        context). all_slots_valid: no -1 in slot_mapping (no mask and no host sync needed)."""
        ctx = self.context(features)
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            store_kv(k, v, kv_cache[i, 0], kv_cache[i, 1], slot_mapping, all_slots_valid)

    def context(self, features: Tensor) -> Tensor:
        """Target features -> the normed context rows [T, hidden] the layers project to K/V."""
        return self.hidden_norm(self.fc(features.to(self.hidden_norm.weight.dtype)))

    def block_hidden(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor,
                     stack: LayerStack | None = None) -> Tensor:
        """Query block tokens [R * Q] (non-causal `meta`) -> final-normed hidden [R * Q, hidden]; `stack` runs the
        decoder layers (default: qwen.run_layers)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return (stack or run_layers)(self.layers, x, cos, sin, kv_cache, meta, self.norm, {})

    def head_logits(self, hidden: Tensor) -> Tensor:
        """[.., hidden] -> the lm_head's output [.., draft_vocab] in the model's dtype, before logit_scale."""
        return self.lm_head(hidden)

    def base_logits(self, hidden: Tensor) -> Tensor:
        """[.., hidden] -> U [.., draft_vocab] fp32, times logit_scale."""
        return self.scaled(self.head_logits(hidden))

    def scaled(self, head: Tensor) -> Tensor:
        """head_logits (or a selection of them) -> fp32, times logit_scale: U."""
        return head.float() * self.config.logit_scale

    def markov_embed(self, prev_ids: Tensor) -> Tensor:
        """Target-vocab ids [B] -> W1 rows [B, rank]."""
        assert self.markov_head is not None, "draft has no Markov head"
        return self.markov_head.markov_w1(prev_ids)

    def markov_bias(self, embed: Tensor) -> Tensor:
        """[B, rank] -> [B, draft_vocab] fp32, times logit_scale."""
        assert self.markov_head is not None, "draft has no Markov head"
        return self.markov_head.markov_w2(embed).float() * self.config.logit_scale

    def confidence_logit(self, hidden: Tensor, embed: Tensor | None) -> Tensor:
        """h_k [B, hidden] (and W1[prev] [B, rank]) -> confidence logit [B] fp32; sigmoid gives c_k."""
        assert self.confidence_head is not None, "draft has no confidence head"
        x = hidden if embed is None or not self.config.confidence_head_with_markov else torch.cat((hidden, embed), -1)
        proj = self.confidence_head.proj
        return F.linear(x.float(), proj.weight.float(), proj.bias.float()).squeeze(-1)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target-vocab ids (identity unless the vocab is reduced)."""
        return draft_ids + self.d2t[draft_ids]
