"""The draft's training forward with DeepSpec's block mask written out densely over every packed query and key
([N * B, T + N * B]): the reference of block_forward.py (same signature), O(all queries x all keys)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_serve.models.dspark import DSparkDraft


def block_mask(ctx_seq: Tensor, ctx_pos: Tensor, block_seq: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """[N * B, T + N * B] bool: a query of block j sees its own sequence's context strictly before anchor j
    and every token of block j (bidirectional), nothing else."""
    n = anchors.shape[0]
    sees_ctx = (ctx_seq[None, :] == block_seq[:, None]) & (ctx_pos[None, :] < anchors[:, None])  # [N, T]
    own = torch.eye(n, dtype=torch.bool, device=anchors.device)  # [N, N]
    allowed = torch.cat((sees_ctx, own.repeat_interleave(block_size, dim=1)), dim=1)  # [N, T + N * B]
    return allowed.repeat_interleave(block_size, dim=0)


def block_forward_dense(draft: DSparkDraft, features: Tensor, ctx_seq: Tensor, ctx_pos: Tensor,
                        block_ids: Tensor, block_seq: Tensor, anchors: Tensor) -> Tensor:
    """Packed context features [T, m * H_t] (sequence ids / positions [T]) and blocks [N, B] anchored at
    `anchors` [N] (sequence ids `block_seq` [N]) -> final-normed hidden [N, B, hidden]."""
    n, bs = block_ids.shape
    cfg = draft.config.layers
    ctx = draft.hidden_norm(draft.fc(features.to(draft.hidden_norm.weight.dtype)))  # [T, hidden]
    x = draft.embed_tokens(block_ids.flatten())  # [N * B, hidden]
    cos_c, sin_c = draft.rotary.cos_sin(ctx_pos, x.dtype)
    positions = (anchors[:, None] + torch.arange(bs, device=anchors.device)).flatten()  # [N * B]
    cos_b, sin_b = draft.rotary.cos_sin(positions, x.dtype)
    mask = block_mask(ctx_seq, ctx_pos, block_seq, anchors, bs)[None]  # [1, N * B, T + N * B]
    groups = cfg.num_heads // cfg.num_kv_heads
    for layer in draft.layers:
        attn = layer.self_attn
        k_ctx, v_ctx = attn.key_value(ctx.to(x.dtype), cos_c, sin_c)  # [T, KV, D]; no input_layernorm on context
        h = layer.input_layernorm(x)
        q = attn.query(h, cos_b, sin_b)  # [N * B, H, D]
        k_blk, v_blk = attn.key_value(h, cos_b, sin_b)
        k = torch.cat((k_ctx, k_blk)).repeat_interleave(groups, dim=1)  # [T + N * B, H, D]
        v = torch.cat((v_ctx, v_blk)).repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=attn.scale)  # [H, N * B, D]
        x = x + attn.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x).view(n, bs, -1)
