"""The DFlash backbone (target features injected as context K/V) with DSpark's Markov and confidence heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_serve.kernels.attention import AttentionMetadata, store_kv
from dspark_serve.kernels.config import use_triton

from .draft_config import DraftConfig
from .layers import RMSNorm, Rotary, keep_tile_major
from .qwen import DecoderLayer, run_layers


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
        """Target features [T, len(target_layer_ids) * target_hidden] -> context K/V of every layer at `positions`.

        One GEMM over all layers' stacked [Wk; Wv], then each layer's k_norm, RoPE and cache write (one Triton
        kernel per layer on the fast path); NOTE: no input_layernorm on the context. all_slots_valid: no -1 in
        slot_mapping (the reference path then needs no mask and no host sync; the kernel skips negative slots).
        """
        hn = self.hidden_norm
        fc = self.fc(features.to(hn.weight.dtype))
        fast = use_triton(fc)
        if fast:
            from dspark_serve.kernels.fused_ops import qk_norm_rotary, rms_norm
        ctx = rms_norm(fc, hn.weight, hn.eps) if fast else hn(fc)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        w, b = self._fused_kv()
        c = self.config.layers
        kv = F.linear(ctx, w, b).view(ctx.shape[0], len(self.layers), 2, c.num_kv_heads, c.head_dim)
        for i, layer in enumerate(self.layers):
            norm, k, v = layer.self_attn.k_norm, kv[:, i, 0], kv[:, i, 1]  # [T, KV, D]
            if fast:  # no query heads: the kernel's k half only, written to the cache with v in the same launch
                kw = norm.weight if norm is not None else None
                qk_norm_rotary(k[:, :0], k, cos, sin, kw, kw, norm.eps if norm is not None else 0.0,
                               (v, kv_cache[i, 0], kv_cache[i, 1], slot_mapping))
            else:
                k = Rotary.apply(norm(k) if norm is not None else k, cos, sin)
                store_kv(k, v, kv_cache[i, 0], kv_cache[i, 1], slot_mapping, all_slots_valid)

    def write_context_per_layer(self, features: Tensor, positions: Tensor, slot_mapping: Tensor,
                                kv_cache: Tensor) -> None:
        """Same as write_context with one k/v projection per layer (the reference for the fused path)."""
        ctx = self.hidden_norm(self.fc(features.to(self.hidden_norm.weight.dtype)))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            store_kv(k, v, kv_cache[i, 0], kv_cache[i, 1], slot_mapping)

    def _fused_kv(self) -> tuple[Tensor, Tensor | None]:
        """[num_layers * 2 * kv_size, hidden]: per layer its k then v rows; cached for inference (rebuilt when the
        weights are replaced, not when they are updated in place)."""
        key = tuple((l.self_attn.k_proj.weight.data_ptr(), l.self_attn.k_proj.weight.device) for l in self.layers)
        if getattr(self, "_fused_key", None) != key:
            attns = [l.self_attn for l in self.layers]
            dt = self.hidden_norm.weight.dtype  # NVFP4 k/v projections are dequantized once into the fused weight
            dense = [p.weight if isinstance(p, nn.Linear) else p.dequantized_weight(dt)
                     for a in attns for p in (a.k_proj, a.v_proj)]
            self._fused = torch.cat(dense).detach()
            has_bias = attns[0].k_proj.bias is not None
            self._fused_bias = torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)]).detach() \
                if has_bias else None
            self._fused_key = key
        return self._fused, self._fused_bias

    def block_hidden(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor) -> Tensor:
        """Query block tokens [R * Q] (non-causal `meta`) -> final-normed hidden [R * Q, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return run_layers(self.layers, x, cos, sin, kv_cache, meta, self.norm, {})

    def fuse_projections(self) -> None:
        """DecoderLayer.fuse for every layer (NVFP4 projections stay separate), with tile-major copies of bf16 ones
        where layers.keep_tile_major says so."""
        tiled = keep_tile_major(self.layers)
        for layer in self.layers:
            layer.fuse(tiled)

    def base_logits(self, hidden: Tensor) -> Tensor:
        """[.., hidden] -> U [.., draft_vocab] fp32, times logit_scale."""
        return self.lm_head(hidden).float() * self.config.logit_scale

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
