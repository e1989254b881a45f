"""Paged KV store and attention over a paged cache (plain PyTorch; the reference every faster kernel matches)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class AttentionMetadata:
    """Where a flat batch of query tokens sits in the paged cache.

    Query token i of sequence b is at position seq_lens[b] - query_lens[b] + i, so every sequence's new
    tokens are its last ones; `causal=False` lets each query see all seq_lens[b] keys (the draft block). Tokens
    past cu_seqlens_q[-1] are padding: no sequence's, their outputs are not defined.
    """

    cu_seqlens_q: Tensor  # [num_reqs + 1] int64, cumulative query lengths
    seq_lens: Tensor  # [num_reqs] int64, keys visible per sequence (context + this step's tokens)
    slot_mapping: Tensor  # [num_tokens] int64, cache slot per new token (block * block_size + offset); -1 skips
    block_table: Tensor  # [num_reqs, max_blocks] int64
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    all_slots_valid: bool = False  # no -1 in slot_mapping: the store needs no mask (and stays graph-capturable)
    prompt_lens: tuple[int, ...] = ()  # host query lengths when every sequence starts at position 0 (fresh prompts)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             all_slots_valid: bool = False) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] -> cache [num_blocks, block_size, num_kv_heads, head_dim]."""
    if all_slots_valid:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _query_layout(meta: AttentionMetadata, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(request index, offset within its query) for every flat token; padding tokens (past the last query) get
    the last request and an offset past its query."""
    cu = meta.cu_seqlens_q
    tok = torch.arange(num_tokens, device=cu.device)
    req = torch.searchsorted(cu[1:], tok, right=True).clamp(max=meta.num_reqs - 1)
    return req, tok - cu[req]


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """q [num_tokens, num_heads, head_dim] over the cached keys of each sequence -> [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    req, off = _query_layout(meta, num_tokens)
    width = meta.max_query_len + 1  # a last, spare row takes the padding tokens (no host sync: capturable)
    off = off.clamp(max=width - 1)
    q_pad = q.new_zeros(meta.num_reqs, width, num_heads, head_dim)  # [R, Q + 1, H, D]
    q_pad[req, off] = q
    kv_pos = torch.arange(meta.max_seq_len, device=q.device)  # [S]
    blocks = meta.block_table[:, (kv_pos // block_size).clamp(max=meta.block_table.shape[1] - 1)]  # [R, S]
    slots = blocks * block_size + kv_pos % block_size
    k = k_cache.view(-1, *k_cache.shape[2:])[slots]  # [R, S, KV, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[slots]
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
    q_pos = (meta.seq_lens - q_lens)[:, None] + torch.arange(width, device=q.device)  # [R, Q + 1]
    mask = kv_pos[None, None, :] < meta.seq_lens[:, None, None]  # [R, 1, S]
    if meta.causal:
        mask = mask & (kv_pos[None, None, :] <= q_pos[:, :, None])  # [R, Q, S]
    mask = mask | (kv_pos == 0)  # padded query rows need one visible key; their output is dropped
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None].expand(-1, 1, width, -1), scale=scale,
        enable_gqa=num_heads != k.shape[2])  # [R, H, Q + 1, D]
    return out.transpose(1, 2)[req, off]


def prompt_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """paged_attention for fresh prompts (meta.prompt_lens, causal): each sequence attends to its own new tokens,
    read back from the slots just written, in one causal SDPA (sequences padded at their end, which causal rows
    never see) -> [num_tokens, num_heads, head_dim]."""
    k = k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping].to(q.dtype)  # [T, KV, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping].to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if len(meta.prompt_lens) == 1:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)  # [1, H, T, D] -> [T, H, D]
    req, off = _query_layout(meta, q.shape[0])
    pads = []
    for x in (q, k, v):
        pad = x.new_zeros(meta.num_reqs, meta.max_query_len, *x.shape[1:])  # [R, Q, heads, D]
        pad[req, off] = x
        pads.append(pad.transpose(1, 2))
    out = F.scaled_dot_product_attention(*pads, is_causal=True, scale=scale, enable_gqa=gqa)  # [R, H, Q, D]
    return out.transpose(1, 2)[req, off]
