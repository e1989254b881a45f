"""Chaining the draft behind the verify launched ahead: the step after it is drafted on the device, from that
verify's accept and features, before the host has read them. The host then finds the next draft already queued
when it reads the accept, so the device does not idle while the host commits and launches (on CUDA, with graphs).

The chained draft assumes the next batch is the launched one with every row committed as the device accepted it;
when that does not hold (a row not taken, a batch change) it is dropped, and what it wrote to the draft cache is
valid context (the accepted rows) or lies where the next block writes first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .draft_side import DraftProposal, DraftSide
from .request import Request

if TYPE_CHECKING:
    from .spec_step import Launched


def chain_draft(draft: DraftSide, launched: "Launched", pos: list[int]) -> None:
    """Queue the draft of the step after `launched` (whose rows anchor at `pos`) behind it on the device."""
    if not getattr(draft, "chain_ahead", False):  # a remote draft, or chaining switched off
        return
    draft.chained = None
    reqs = launched.reqs
    if draft.graphs is None or any(f is None for f in launched.feats) \
            or any(r.draft_context_len != p or r.pending_features for r, p in zip(reqs, pos)):
        return
    pool, q_len = draft.allocator, draft.query_len
    need = [max(0, pool.blocks_for(p + k + 1 + q_len) - len(r.draft_blocks)) for r, p, k in zip(reqs, pos, launched.n)]
    if sum(need) > pool.num_free:
        return
    for r, k in zip(reqs, need):
        r.draft_blocks.extend(pool.allocate_blocks(k) if k else [])
    proposal = draft.propose_chained(launched.packed, pos, launched.n, [r.draft_blocks for r in reqs],
                                     [r.params.temperature for r in reqs], [r.seed for r in reqs], launched.feats)
    if proposal is not None:
        draft.chained = (launched.packed, proposal)


def take_chained(draft: DraftSide, launched: "Launched | None", rows: dict[Request, int],
                 reqs: list[Request]) -> DraftProposal | None:
    """The chained draft, if `reqs` are exactly the rows of the launch it was chained on, all taken; the requests
    are then marked as having handed over their new context (the chained draft wrote it)."""
    chained = getattr(draft, "chained", None)
    if chained is None:
        return None
    draft.chained = None
    if launched is None or chained[0] is not launched.packed \
            or len(reqs) != len(launched.reqs) or [rows.get(r) for r in reqs] != list(range(len(reqs))):
        return None
    for r in reqs:
        r.draft_context_len, r.pending_features = r.num_computed, []
    return chained[1]
