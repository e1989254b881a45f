"""StepPipeline: what one step leaves queued on the device for the next (the executor owns it): the verify launched
ahead, the draft made ahead, and the draft chained behind the verify launched ahead.

Chaining: the step after the launched verify is drafted on the device from that verify's accept and features,
before the host has read them, so the device does not idle while the host commits and launches (CUDA, graphs). It
assumes the next batch is the launched one with every row committed as the device accepted it; otherwise it is
dropped, and what it wrote to the draft cache is valid context (the accepted rows) or lies where the next block
writes first. Nothing here allocates cache blocks: a piece whose rows lack the slots is not launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from ..drafter import DraftContext, DraftInput, DraftProposal, Drafter
from ..logits_processing import StepLogprobs
from ..request import Request


@runtime_checkable
class ChainingDrafter(Protocol):
    """A draft that can queue its step behind a verify still on the device (engine/draft_side.py's DraftSide with
    static shapes)."""

    @property
    def can_chain(self) -> bool: ...

    @property
    def block_size(self) -> int: ...

    def propose_chained(self, packed: Tensor, anchor_pos: list[int], tables: list[list[int]],
                        temperature: list[float], seeds: list[int], feats: Tensor) -> DraftProposal | None:
        """The draft of the step after a verify still on the device (packed: its accept, rejection.pack_accept;
        feats [R, 1 + N, F] its features), queued behind it; None when it cannot be staged."""
        ...


@runtime_checkable
class ContextWriter(Protocol):
    """A draft that can write context K/V alone (engine/draft_side.py's DraftSide)."""

    def write_context(self, inp: DraftInput) -> None: ...


@dataclass(frozen=True)
class Launched:
    """A verify queued on the device whose accept the host has not read yet (finishing it is the one sync)."""

    reqs: list[Request]
    proposal: DraftProposal | None
    caps: list[int]  # drafts each row could verify (how many it did is in `packed`)
    feats: Tensor | None  # [R, 1 + W, F] target features of each row's anchor and drafts
    packed: Tensor  # [R, 2 + W + 1] int64 on the device: verified, accepted, output tokens (rejection.pack_accept)
    draft_ms: float
    launched_at: float  # perf_counter once the draft was in hand
    key: list[tuple] = ()  # launched ahead: per request the (anchor_pos, num_computed, anchor) it assumed
    host: Tensor | None = None  # on CUDA: `packed` copied to pinned memory as the accept ends ...
    ready: torch.cuda.Event | None = None  # ... and its event, so that reading it waits for nothing queued later
    logprobs: StepLogprobs | None = None  # of the output tokens, for the rows that asked
    logprobs_host: Tensor | None = None  # on CUDA: its values in pinned memory, copied before `ready`
    conf_host: Tensor | None = None  # [R, N] the draft's c_k, copied beside `packed` (None without them)


DraftKey = list[tuple[Request, int, int]]  # per request of a draft made ahead: (request, anchor_pos, num_computed)
Chained = tuple[Tensor, DraftProposal]  # (the accept it reads, packed [R, 1 + W] on the device; the proposal)


class StepPipeline:
    """The launch-ahead state carried from one step to the next, and its switches (on where the device is CUDA):

    - step_ahead: the next step's verify and accept are launched before the host's bookkeeping of this one;
    - draft_ahead: the next step's draft is made right after this step's accept;
    - chain_ahead: with a draft that can chain, the draft after the verify launched ahead is queued behind it.

    Each piece is taken (and cleared) by the step that uses it, and used only if its batch is the one predicted."""

    def __init__(self, device: torch.device, draft: Drafter | None) -> None:
        self.step_ahead = device.type == "cuda"
        self.draft_ahead = self.chain_ahead = False
        self.launched: Launched | None = None
        self.drafted: tuple[DraftKey, DraftProposal] | None = None
        self.chained: Chained | None = None
        self.use_draft(draft)

    def use_draft(self, draft: Drafter | None) -> None:
        """A new draft (None: plain decoding): its switches follow its device, and nothing queued is kept."""
        self.draft_ahead = self.chain_ahead = draft is not None and draft.device.type == "cuda"
        self.clear()

    def clear(self) -> None:
        self.launched = self.drafted = self.chained = None

    def take_launched(self, reqs: list[Request]) -> tuple[Launched | None, dict[Request, int]]:
        """The step launched ahead and, for each request of `reqs` whose row it can stand for, that row."""
        launched, self.launched = self.launched, None
        if launched is None:
            return None, {}
        live = set(reqs)
        rows = {r: i for i, (r, key) in enumerate(zip(launched.reqs, launched.key))
                if r in live and key == (r.anchor_pos, r.num_computed, r.anchor)}
        return (launched if rows else None), rows

    def keep_drafted(self, reqs: list[Request], anchor_pos: list[int], computed: list[int],
                     proposal: DraftProposal) -> None:
        """The next step's draft, made for `reqs` anchored at `anchor_pos` with `computed` target positions in
        their caches once this step is committed (checked by take_drafted)."""
        self.drafted = (list(zip(reqs, anchor_pos, computed)), proposal)

    def take_drafted(self, reqs: list[Request], anchor_pos: list[int] | None = None,
                     computed: list[int] | None = None) -> DraftProposal | None:
        """The proposal drafted ahead at the end of the previous step, if it was drafted for exactly this batch (at
        `anchor_pos` with `computed`, by default the requests' own)."""
        drafted, self.drafted = self.drafted, None
        if drafted is None:
            return None
        key, proposal = drafted
        pos = [r.anchor_pos for r in reqs] if anchor_pos is None else anchor_pos
        done = [r.num_computed for r in reqs] if computed is None else computed
        if len(key) != len(reqs) or any(r is not k or p != kp or c != kc
                                         for r, p, c, (k, kp, kc) in zip(reqs, pos, done, key)):
            return None
        return proposal

    def chain(self, draft: Drafter, contexts: list[DraftContext], pos: list[int]) -> None:
        """Queue the draft of the step after `launched` (whose rows anchor at `pos`) behind it on the device."""
        launched = self.launched
        if not (self.chain_ahead and isinstance(draft, ChainingDrafter) and draft.can_chain) \
                or launched.feats is None or any(c.length != p or c.pending for c, p in zip(contexts, pos)):
            return
        reqs, q_len = launched.reqs, draft.query_len
        if any(-(-(p + k + 1 + q_len) // draft.block_size) > len(r.draft_blocks)
               for r, p, k in zip(reqs, pos, launched.caps)):
            return
        proposal = draft.propose_chained(launched.packed, pos, [r.draft_blocks for r in reqs],
                                         [r.params.temperature for r in reqs], [r.seed for r in reqs],
                                         launched.feats)
        self.chained = None if proposal is None else (launched.packed, proposal)

    def take_chained(self, launched: Launched | None, rows: dict[Request, int], reqs: list[Request],
                     contexts: list[DraftContext], computed: list[int]) -> DraftProposal | None:
        """The chained draft, if `reqs` are exactly the rows of `launched` (the launch it was chained on), all
        taken; the requests then hand over their new context up to `computed` (the chained draft wrote it)."""
        chained, self.chained = self.chained, None
        if chained is None or launched is None or chained[0] is not launched.packed \
                or len(reqs) != len(launched.reqs) or [rows.get(r) for r in reqs] != list(range(len(reqs))):
            return None
        for n, c in zip(computed, contexts):
            c.length, c.pending = n, []
        return chained[1]
