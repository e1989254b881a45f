"""Anchor sampling and block construction (anchor-first `[token[a], MASK x (B-1)]`) over packed sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packed:
    """Several sequences laid end to end; the target pass and the draft's context both use this layout."""

    ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] bool, response tokens
    seq: Tensor  # [T] int64, sequence index
    pos: Tensor  # [T] int64, position within its sequence
    offsets: list[int]  # start of each sequence in the packed layout
    lengths: list[int]


@dataclass(frozen=True)
class Blocks:
    ids: Tensor  # [N, B] anchor then mask tokens
    seq: Tensor  # [N] sequence index
    anchors: Tensor  # [N] anchor position within its sequence
    labels: Tensor  # [N, B] token[a + 1 .. a + B] (0 where past the end)
    eval_mask: Tensor  # [N, B] float, cumprod of valid labels
    prev_ids: Tensor  # [N, B] teacher-forced Markov inputs: [anchor, label_0 .. label_{B-2}]
    target_index: Tensor  # [N, B] packed index a + k whose target hidden predicts label k


def pack(seqs: list[tuple[Tensor, Tensor]]) -> Packed:
    """[(ids [T_s], loss_mask [T_s])] -> Packed."""
    lengths = [int(ids.shape[0]) for ids, _ in seqs]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return Packed(ids=torch.cat([ids for ids, _ in seqs]), loss_mask=torch.cat([m for _, m in seqs]).bool(),
                  seq=torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)]),
                  pos=torch.cat([torch.arange(n) for n in lengths]), offsets=offsets, lengths=lengths)


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator | None = None) -> Tensor:
    """Up to `num_anchors` sorted positions a with loss_mask[a] and loss_mask[a + 1], uniformly without replacement."""
    m = loss_mask.bool()
    cand = torch.nonzero(m[:-1] & m[1:]).flatten()  # [C]
    if cand.numel() > num_anchors:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]].sort().values
    return cand


def build_blocks(packed: Packed, anchors: list[Tensor], block_size: int, mask_token_id: int) -> Blocks:
    """Per-sequence anchor positions -> the blocks, labels and masks of all sequences."""
    seq = torch.cat([torch.full((a.numel(),), i, dtype=torch.int64) for i, a in enumerate(anchors)])  # [N]
    anchor = torch.cat(anchors)  # [N]
    start = torch.tensor(packed.offsets)[seq]  # [N]
    length = torch.tensor(packed.lengths)[seq]
    k = torch.arange(1, block_size + 1)
    label_pos = anchor[:, None] + k  # [N, B] position of label k - 1 within its sequence
    inside = label_pos < length[:, None]
    label_idx = torch.where(inside, start[:, None] + label_pos, 0)
    labels = torch.where(inside, packed.ids[label_idx], 0)
    valid = inside & packed.loss_mask[label_idx]
    eval_mask = torch.cumprod(valid.long(), dim=1).float()
    anchor_ids = packed.ids[start + anchor]  # [N]
    ids = torch.full((anchor.numel(), block_size), mask_token_id, dtype=torch.int64)
    ids[:, 0] = anchor_ids
    prev = torch.cat((anchor_ids[:, None], labels[:, :-1]), dim=1)
    target_index = torch.where(inside, start[:, None] + label_pos - 1, 0)
    return Blocks(ids=ids, seq=seq, anchors=anchor, labels=labels, eval_mask=eval_mask, prev_ids=prev,
                  target_index=target_index)
