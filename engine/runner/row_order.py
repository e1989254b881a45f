"""The target's forward and logits one token row at a time (the deterministic mode): every reduction a row takes part
in (RMSNorm, the projections, attention over its context, the lm_head) runs on tensors of that row's own shape, so
its result does not depend on the batch, the number of verify rows, a prompt chunk's length or its place in them.

A row is the model's own forward of one token at its position (what plain decoding at batch 1 runs): a prompt is
prefilled token by token in position order, each layer writing the row's K/V before the next row reads it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.models.qwen import QwenForCausalLM


def row_metadata(meta: AttentionMetadata, req: int, pos: int, slot: int, block_size: int) -> AttentionMetadata:
    """The metadata of one query token of sequence `req` at position `pos` (its keys: positions 0..pos)."""
    dev = meta.seq_lens.device
    blocks = meta.block_table[req:req + 1, :pos // block_size + 1]  # [1, blocks of positions 0..pos]
    return AttentionMetadata(cu_seqlens_q=torch.tensor([0, 1], device=dev),
                             seq_lens=torch.tensor([pos + 1], device=dev),
                             slot_mapping=torch.tensor([slot], device=dev), block_table=blocks,
                             max_query_len=1, max_seq_len=pos + 1, causal=True, all_slots_valid=slot >= 0)


@torch.inference_mode()
def forward_by_row(model: QwenForCausalLM, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                   kv_cache: Tensor, capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
    """QwenForCausalLM.forward, one token row at a time -> (hidden [T, hidden], captured | None). Padding tokens
    (past cu_seqlens_q[-1]) get zeros."""
    if not meta.causal:
        raise ValueError("forward_by_row runs the causal target; got non-causal metadata")
    block_size = kv_cache.shape[3]
    cu, seq_lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
    pos, slots = positions.tolist(), meta.slot_mapping.tolist()
    hidden: list[Tensor] = []
    feats: list[Tensor] = []
    for b in range(meta.num_reqs):
        first = seq_lens[b] - (cu[b + 1] - cu[b])  # the sequence's first new position
        for i in range(cu[b], cu[b + 1]):
            if pos[i] != first + i - cu[b]:
                raise ValueError(f"token {i} is at position {pos[i]}, its metadata says {first + i - cu[b]}")
            h, f = model(input_ids[i:i + 1], positions[i:i + 1], row_metadata(meta, b, pos[i], slots[i], block_size),
                         kv_cache, capture_layers)
            hidden.append(h)
            if f is not None:
                feats.append(f)
    pad = input_ids.shape[0] - cu[-1]
    if pad:
        hidden.append(hidden[0].new_zeros(pad, hidden[0].shape[-1]))
        if feats:
            feats.append(feats[0].new_zeros(pad, feats[0].shape[-1]))
    return torch.cat(hidden), (torch.cat(feats) if feats else None)


@torch.inference_mode()
def logits_by_row(model: QwenForCausalLM, hidden: Tensor) -> Tensor:
    """[T, hidden] -> [T, vocab] fp32, each row's lm_head product on its own (a fresh one-row copy: the same
    operands, the same alignment, whatever row of `hidden` it was)."""
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, model.config.vocab_size, dtype=torch.float32)
    return torch.cat([model.compute_logits(hidden[i:i + 1].clone()) for i in range(hidden.shape[0])])
