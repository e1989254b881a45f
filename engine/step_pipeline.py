"""StepPipeline: what one speculative step leaves queued on the device for the next (engine/spec_step.py runs it;
the scheduler owns it): the verify launched ahead, the draft made ahead and the draft chained behind the verify."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .draft_chain import Chained, chain_draft, take_chained
from .drafter import DraftProposal, Drafter
from .logits_processing import StepLogprobs
from .request import Request


@dataclass(frozen=True)
class Launched:
    """A step queued on the device whose accept counts the host has not read yet (finishing it is the one sync)."""

    reqs: list[Request]
    proposal: DraftProposal | None
    n: list[int]  # drafts verified per request
    feats: list[Tensor | None]  # per request: target features of its anchor and verified drafts
    packed: Tensor  # [R, 1 + W] int64 on the device: accepted count, then the output tokens (-1 padded)
    draft_ms: float
    launched_at: float  # perf_counter once the draft was in hand
    key: list[tuple] = ()  # launched ahead: per request the (anchor_pos, num_computed, anchor) it assumed
    host: Tensor | None = None  # on CUDA: `packed` copied to pinned memory as the accept ends ...
    ready: torch.cuda.Event | None = None  # ... and its event, so that reading it waits for nothing queued later
    logprobs: StepLogprobs | None = None  # of the output tokens, for the rows that asked
    logprobs_host: Tensor | None = None  # on CUDA: its values in pinned memory, copied before `ready`


DraftKey = list[tuple[Request, int, int]]  # per request of a draft made ahead: (request, anchor_pos, num_computed)


class StepPipeline:
    """The launch-ahead state carried from one step to the next, and its switches (on where the device is CUDA):

    - step_ahead: the next step's verify and accept are launched before the host's bookkeeping of this one;
    - draft_ahead: the next step's draft is made right after this step's accept;
    - chain_ahead: with a draft that can chain, the draft after the verify launched ahead is queued behind it on
      the device, reading its accept there (engine/draft_chain.py).

    Each piece is taken (and cleared) by the step that uses it, and used only if its batch is the one predicted."""

    def __init__(self, device: torch.device, draft: Drafter | None) -> None:
        self.step_ahead = device.type == "cuda"
        self.draft_ahead = self.chain_ahead = False
        self.launched: Launched | None = None  # the next step's verify, launched ahead
        self.drafted: tuple[DraftKey, DraftProposal] | None = None  # the next step's draft, made ahead
        self.chained: Chained | None = None  # the draft queued behind `launched`
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

    def keep_drafted(self, reqs: list[Request], anchor_pos: list[int], proposal: DraftProposal) -> None:
        """The next step's draft, made for `reqs` anchored at `anchor_pos` (checked by take_drafted)."""
        self.drafted = ([(r, p, r.num_computed) for r, p in zip(reqs, anchor_pos)], proposal)

    def take_drafted(self, reqs: list[Request], anchor_pos: list[int] | None = None) -> DraftProposal | None:
        """The proposal drafted ahead at the end of the previous step, if it was drafted for exactly this batch (at
        `anchor_pos`, by default the requests' own)."""
        drafted, self.drafted = self.drafted, None
        if drafted is None:
            return None
        key, proposal = drafted
        pos = [r.anchor_pos for r in reqs] if anchor_pos is None else anchor_pos
        if len(key) != len(reqs) or any(r is not k or p != kp or r.num_computed != c
                                         for r, p, (k, kp, c) in zip(reqs, pos, key)):
            return None
        return proposal

    def chain(self, draft: Drafter, pos: list[int]) -> None:
        """Queue the draft of the step after `launched` (whose rows anchor at `pos`) behind it on the device."""
        if not self.chain_ahead:
            return
        launched = self.launched
        self.chained = chain_draft(draft, launched.reqs, launched.packed, launched.n, launched.feats, pos)

    def take_chained(self, launched: Launched | None, rows: dict[Request, int],
                     reqs: list[Request]) -> DraftProposal | None:
        """The chained draft, if `reqs` are exactly the rows of `launched` (the launch it was chained on), all
        taken; the requests then hand over their new context (the chained draft wrote it)."""
        chained, self.chained = self.chained, None
        if chained is None or launched is None:
            return None
        return take_chained(chained, launched.packed, launched.reqs, rows, reqs)
