"""The draft's training forward: many anchor blocks at once over packed sequences, with DeepSpec's block mask
(a block sees its own sequence's context strictly before its anchor, and all of its own tokens).

Attention runs per sequence, padded: each block's queries score the context of its own sequence
([S, KV, G * Nmax * B, Lmax]) and the B tokens of its own block ([.., B, B]), one softmax over both; nothing is
computed against other sequences or other blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_serve.models.dspark import DSparkDraft


def _padded(group: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """Sorted group ids [X] -> (index [G, Lmax] into X, valid [G, Lmax]); padding points at row 0."""
    counts = torch.bincount(group, minlength=num_groups)  # [G]
    starts = torch.cumsum(counts, 0) - counts
    width = int(counts.max()) if group.numel() else 0
    slot = torch.arange(width, device=group.device)[None, :]  # [1, Lmax]
    valid = slot < counts[:, None]
    return torch.where(valid, starts[:, None] + slot, 0), valid


def block_forward(draft: DSparkDraft, features: Tensor, ctx_seq: Tensor, ctx_pos: Tensor, block_ids: Tensor,
                  block_seq: Tensor, anchors: Tensor) -> Tensor:
    """Packed context features [T, m * H_t] (sequence ids / positions [T], grouped by sequence) and blocks [N, B]
    anchored at `anchors` [N] (sequence ids `block_seq` [N], ascending) -> final-normed hidden [N, B, hidden]."""
    n, bs = block_ids.shape
    cfg = draft.config.layers
    kv, d = cfg.num_kv_heads, cfg.head_dim
    groups = cfg.num_heads // kv
    num_seqs = int(torch.maximum(ctx_seq.max(), block_seq.max())) + 1
    ctx_index, ctx_valid = _padded(ctx_seq, num_seqs)  # [S, L]
    blk_index, blk_valid = _padded(block_seq, num_seqs)  # [S, Nb]
    s, nb, lc = blk_index.shape[0], blk_index.shape[1], ctx_index.shape[1]
    sees = (ctx_pos[ctx_index][:, None, :] < anchors[blk_index][:, :, None]) & ctx_valid[:, None, :]  # [S, Nb, L]
    acc = torch.promote_types(draft.hidden_norm.weight.dtype, torch.float32)  # softmax dtype
    bias = torch.zeros(s, 1, 1, nb, 1, lc, device=features.device, dtype=acc).masked_fill(
        ~sees[:, None, None, :, None, :], float("-inf"))  # [S, 1, 1, Nb, 1, L]

    ctx = draft.hidden_norm(draft.fc(features.to(draft.hidden_norm.weight.dtype)))  # [T, hidden]
    x = draft.embed_tokens(block_ids.flatten())  # [N * B, hidden]
    cos_c, sin_c = draft.rotary.cos_sin(ctx_pos, x.dtype)
    positions = (anchors[:, None] + torch.arange(bs, device=anchors.device)).flatten()  # [N * B]
    cos_b, sin_b = draft.rotary.cos_sin(positions, x.dtype)
    for layer in draft.layers:
        attn = layer.self_attn
        k_ctx, v_ctx = attn.key_value(ctx.to(x.dtype), cos_c, sin_c)  # [T, KV, D]; no input_layernorm on context
        h = layer.input_layernorm(x)
        q = attn.query(h, cos_b, sin_b).view(n, bs, kv, groups, d)[blk_index]  # [S, Nb, B, KV, G, D]
        k_blk, v_blk = (t.view(n, bs, kv, d)[blk_index] for t in attn.key_value(h, cos_b, sin_b))  # [S, Nb, B, KV, D]
        q = q.permute(0, 3, 4, 1, 2, 5)  # [S, KV, G, Nb, B, D]
        k_c, v_c = (t[ctx_index].permute(0, 2, 1, 3) for t in (k_ctx, v_ctx))  # [S, KV, L, D]
        sc = (q.reshape(s, kv, -1, d) @ k_c.transpose(-1, -2)).view(s, kv, groups, nb, bs, lc)
        sb = torch.einsum("skgnid,snjkd->skgnij", q, k_blk)  # [S, KV, G, Nb, B, B]
        p = (torch.cat((sc.to(acc) + bias, sb.to(acc)), -1) * attn.scale).softmax(-1).to(q.dtype)
        o = (p[..., :lc].reshape(s, kv, -1, lc) @ v_c).view(s, kv, groups, nb, bs, d) \
            + torch.einsum("skgnij,snjkd->skgnid", p[..., lc:], v_blk)  # [S, KV, G, Nb, B, D]
        o = o.permute(0, 3, 4, 1, 2, 5)[blk_valid].reshape(n * bs, -1)  # [N * B, H * D], blocks in input order
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x).view(n, bs, -1)


def block_logits(draft: DSparkDraft, hidden: Tensor, prev_ids: Tensor) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced heads: hidden [N, B, hidden], previous ids [N, B] -> (draft logits [N, B, V] with the
    Markov bias, in the lm_head's compute dtype; confidence logits [N, B] fp32 or None)."""
    logits = draft.lm_head(hidden)
    embed = None
    if draft.markov_head is not None:
        embed = draft.markov_embed(prev_ids)  # [N, B, rank]
        logits = logits + draft.markov_head.markov_w2(embed)
    if draft.config.logit_scale != 1.0:
        logits = logits * draft.config.logit_scale
    conf = draft.confidence_logit(hidden, embed) if draft.confidence_head is not None else None
    return logits, conf
