"""The draft as the speculative step sees it: its input, its proposal, and the Drafter interface that the in-process
DraftSide and a draft behind the step channel (actors/remote_draft.py) implement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .host_copy import to_device
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


@dataclass
class DraftContext:
    """The executor's record of one request's draft context: K/V written for positions [0, length), and the
    target's features of the positions after it that the draft has not been given yet."""

    length: int = 0
    # positions length .. num_computed - 1: (a step's features [rows, F], first row, rows) each, sliced only when
    # the draft takes them (a step that drafts nothing pays no per-row tensor op)
    pending: list[tuple[Tensor, int, int]] = field(default_factory=list)

    def reset(self, length: int = 0) -> None:
        self.length, self.pending = length, []


def pending_features(contexts: list[DraftContext]) -> Tensor | None:
    """The contexts' pending features in order, [sum of rows, F]: one index_select over the steps they came from."""
    entries = [e for c in contexts for e in c.pending]
    if len(entries) <= 1:
        return entries[0][0][entries[0][1]:entries[0][1] + entries[0][2]] if entries else None
    bases: dict[int, tuple[int, Tensor]] = {}  # id(step features) -> (its first row in the joined tensor, it)
    rows, size = [], 0
    for base, first, n in entries:
        if id(base) not in bases:
            bases[id(base)] = (size, base)
            size += base.shape[0]
        at = bases[id(base)][0] + first
        rows.extend(range(at, at + n))
    parts = [b for _, b in bases.values()]
    joined = parts[0] if len(parts) == 1 else torch.cat(parts)
    return joined.index_select(0, to_device(rows, torch.int64, joined.device))


def draft_input(reqs: list[Request], contexts: list[DraftContext], anchors: list[int] | None = None,
                anchor_pos: list[int] | None = None, computed: list[int] | None = None) -> DraftInput:
    """Collect the step's draft input (host tensors, except the features) and mark the pending features as
    handed over. `anchors` / `anchor_pos` / `computed` override the requests' own (drafting ahead of the
    commit)."""
    computed = [r.num_computed for r in reqs] if computed is None else computed
    width = max(len(r.draft_blocks) for r in reqs)
    ints = torch.tensor([[r.anchor for r in reqs] if anchors is None else anchors,
                         [r.anchor_pos for r in reqs] if anchor_pos is None else anchor_pos,
                         [c.length for c in contexts], [n - c.length for n, c in zip(computed, contexts)],
                         [r.seed for r in reqs]], dtype=torch.int64)  # [5, R]
    inp = DraftInput(
        anchors=ints[0], anchor_pos=ints[1], ctx_start=ints[2], ctx_len=ints[3],
        features=pending_features(contexts),
        block_table=torch.tensor([r.draft_blocks + [0] * (width - len(r.draft_blocks)) for r in reqs]),
        temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32), seeds=ints[4],
        grammars=tuple(r.grammar for r in reqs) if anchors is None and any(r.grammar for r in reqs) else None)
    for n, c in zip(computed, contexts):
        c.length, c.pending = n, []
    return inp


@dataclass(frozen=True)
class DraftProposal:
    tokens: Tensor  # [R, N] int64, target-vocab ids
    probs: Tensor | None  # [R, N, V_target] q each token was drawn from (None when every row is greedy)
    confidence_logits: Tensor | None  # [R, N] fp32, conditional acceptance logits (None without the head)
    transfer_ms: float = 0.0  # step-channel time of a remote draft (wall time minus the draft's compute)
    cand_ids: Tensor | None = None  # [R, N, K] target ids: with top-k drafting q lives on these candidates only
    cand_probs: Tensor | None = None  # [R, N, K] q on them (`probs` is then None)

    def rows(self, index: list[int]) -> DraftProposal:
        """The proposal of these rows only, in this order (on CUDA without waiting for the device)."""
        at = to_device(index, torch.int64, self.tokens.device)
        pick = lambda t: t.index_select(0, at) if t is not None else None  # noqa: E731
        return DraftProposal(pick(self.tokens), pick(self.probs), pick(self.confidence_logits), self.transfer_ms,
                             pick(self.cand_ids), pick(self.cand_probs))

    def dense_probs(self, vocab_size: int) -> Tensor | None:
        """q as [R, N, V_target] (zero outside the candidates), or None when every row is greedy."""
        if self.cand_ids is None:
            return self.probs
        shape = (*self.cand_ids.shape[:2], vocab_size)
        return torch.zeros(shape, device=self.cand_ids.device).scatter_(-1, self.cand_ids, self.cand_probs)


@runtime_checkable
class Drafter(Protocol):
    """What the engine uses of a draft: one proposal per step. Its cache's block ids are the verifier's
    KVCacheManager's (a pool of `num_blocks`) and travel in each DraftInput; `propose` raises DraftUnavailable
    when the draft cannot answer."""

    @property
    def num_speculative_tokens(self) -> int: ...  # N: drafts per step at most

    @property
    def query_len(self) -> int: ...  # cache slots a step's block occupies past the anchor's position

    @property
    def num_blocks(self) -> int: ...  # blocks of the draft's context cache

    @property
    def device(self) -> torch.device: ...  # where the proposal arrives (drafting ahead is on for CUDA)

    @property
    def has_confidence(self) -> bool: ...  # its proposals carry confidence logits

    def propose(self, inp: DraftInput) -> DraftProposal: ...
