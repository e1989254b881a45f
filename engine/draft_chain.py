"""Chaining the draft behind the verify launched ahead: the step after it is drafted on the device, from that
verify's accept and features, before the host has read them. The host then finds the next draft already queued
when it reads the accept, so the device does not idle while the host commits and launches (on CUDA, with graphs).

The chained draft assumes the next batch is the launched one with every row committed as the device accepted it;
when that does not hold (a row not taken, a batch change) it is dropped, and what it wrote to the draft cache is
valid context (the accepted rows) or lies where the next block writes first. engine/step_pipeline.py keeps it
between the steps.
"""

from __future__ import annotations

from torch import Tensor

from .drafter import DraftProposal, Drafter
from .request import Request

Chained = tuple[Tensor, DraftProposal]  # (the accept it reads, packed [R, 1 + W] on the device; the proposal)


def chain_draft(draft: Drafter, reqs: list[Request], packed: Tensor, n: list[int], feats: list[Tensor | None],
                pos: list[int]) -> Chained | None:
    """Queue the draft of the step after a launched verify (rows `reqs` anchored at `pos`, `n` drafts verified,
    their features `feats`, its accept `packed`) behind it on the device; None when it cannot be."""
    if not draft.can_chain or any(f is None for f in feats) \
            or any(r.draft_context_len != p or r.pending_features for r, p in zip(reqs, pos)):
        return None
    pool, q_len = draft.allocator, draft.query_len
    need = [max(0, pool.blocks_for(p + k + 1 + q_len) - len(r.draft_blocks)) for r, p, k in zip(reqs, pos, n)]
    if sum(need) > pool.num_free:
        return None
    for r, k in zip(reqs, need):
        r.draft_blocks.extend(pool.allocate_blocks(k) if k else [])
    proposal = draft.propose_chained(packed, pos, n, [r.draft_blocks for r in reqs],
                                     [r.params.temperature for r in reqs], [r.seed for r in reqs], feats)
    return None if proposal is None else (packed, proposal)


def take_chained(chained: Chained, packed: Tensor, launched: list[Request], rows: dict[Request, int],
                 reqs: list[Request]) -> DraftProposal | None:
    """The chained draft, if it was chained on the launch whose accept is `packed` (of rows `launched`) and `reqs`
    are exactly those rows, all taken; the requests are then marked as having handed over their new context."""
    if chained[0] is not packed or len(reqs) != len(launched) \
            or [rows.get(r) for r in reqs] != list(range(len(reqs))):
        return None
    for r in reqs:
        r.draft_context_len, r.pending_features = r.num_computed, []
    return chained[1]
