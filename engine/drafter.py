"""The draft as the speculative step sees it: its input, its proposal, and the Drafter interface that the in-process
DraftSide and a draft behind the step channel (actors/remote_draft.py) implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .kv_cache import BlockAllocator
from .request import Request


class DraftUnavailable(RuntimeError):
    """The draft cannot answer (its process or device is gone): the step is redone as plain decoding."""


@dataclass(frozen=True)
class DraftInput:
    """Everything the draft needs for one step; it is also what crosses the step channel to a remote draft."""

    anchors: Tensor  # [R] int64, the last committed token of each request
    anchor_pos: Tensor  # [R] int64, its position (the block occupies anchor_pos .. anchor_pos + query_len - 1)
    ctx_start: Tensor  # [R] int64, first position whose context K/V the draft has not written yet
    ctx_len: Tensor  # [R] int64, new context rows per request
    features: Tensor | None  # [sum(ctx_len), len(target_layer_ids) * target_hidden] target features
    block_table: Tensor  # [R, max_blocks] int64, the draft cache blocks of each request
    temperature: Tensor  # [R] fp32 (0 = greedy)
    seeds: Tensor  # [R] int64
    grammars: tuple | None = None  # per row its GrammarState or None, drafting at the committed output (in process
    # only: a draft behind the step channel drafts unconstrained)


def draft_input(reqs: list[Request], anchors: list[int] | None = None,
                anchor_pos: list[int] | None = None) -> DraftInput:
    """Collect the step's draft input (host tensors, except the features) and mark the pending features as
    handed over. `anchors` / `anchor_pos` override the requests' own (drafting ahead of the commit)."""
    width = max(len(r.draft_blocks) for r in reqs)
    feats = [f for r in reqs for f in r.pending_features]
    ints = torch.tensor([[r.anchor for r in reqs] if anchors is None else anchors,
                         [r.anchor_pos for r in reqs] if anchor_pos is None else anchor_pos,
                         [r.draft_context_len for r in reqs], [r.num_computed - r.draft_context_len for r in reqs],
                         [r.seed for r in reqs]], dtype=torch.int64)  # [5, R]
    inp = DraftInput(
        anchors=ints[0], anchor_pos=ints[1], ctx_start=ints[2], ctx_len=ints[3],
        features=torch.cat(feats) if len(feats) > 1 else (feats[0] if feats else None),
        block_table=torch.tensor([r.draft_blocks + [0] * (width - len(r.draft_blocks)) for r in reqs]),
        temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32), seeds=ints[4],
        grammars=tuple(r.grammar for r in reqs) if anchors is None and any(r.grammar for r in reqs) else None)
    for r in reqs:
        r.draft_context_len, r.pending_features = r.num_computed, []
    return inp


@dataclass(frozen=True)
class DraftProposal:
    tokens: Tensor  # [R, N] int64, target-vocab ids
    probs: Tensor | None  # [R, N, V_target] q each token was drawn from (None when every row is greedy)
    confidence_logits: Tensor | None  # [R, N] fp32, conditional acceptance logits (None without the head)
    transfer_ms: float = 0.0  # step-channel time of a remote draft (wall time minus the draft's compute)
    cand_ids: Tensor | None = None  # [R, N, K] target ids: with top-k drafting q lives on these candidates only
    cand_probs: Tensor | None = None  # [R, N, K] q on them (`probs` is then None)

    def dense_probs(self, vocab_size: int) -> Tensor | None:
        """q as [R, N, V_target] (zero outside the candidates), or None when every row is greedy."""
        if self.cand_ids is None:
            return self.probs
        shape = (*self.cand_ids.shape[:2], vocab_size)
        return torch.zeros(shape, device=self.cand_ids.device).scatter_(-1, self.cand_ids, self.cand_probs)


@runtime_checkable
class Drafter(Protocol):
    """What the scheduler and the speculative step use of a draft. The draft cache's block ids are bookkept in
    `allocator` (in the verifier's process) and travel in each DraftInput; `propose` raises DraftUnavailable when
    the draft cannot answer."""

    @property
    def num_speculative_tokens(self) -> int: ...  # N: drafts per step at most

    @property
    def query_len(self) -> int: ...  # cache slots a step's block occupies past the anchor's position

    @property
    def allocator(self) -> BlockAllocator: ...  # the draft cache's block pool

    @property
    def device(self) -> torch.device: ...  # where the proposal arrives (drafting ahead is on for CUDA)

    @property
    def can_chain(self) -> bool: ...  # whether propose_chained can queue a draft behind a verify on this device

    def propose(self, inp: DraftInput) -> DraftProposal: ...

    def propose_chained(self, packed: Tensor, anchor_pos: list[int], n: list[int], tables: list[list[int]],
                        temperature: list[float], seeds: list[int], feats: list[Tensor]) -> DraftProposal | None:
        """The draft of the step after a verify still on the device (packed [R, 1 + W]: its accept), queued behind
        it; None when it cannot be staged."""
        ...
