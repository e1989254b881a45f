"""Measuring StepCosts when the engine starts: with CUDA graphs, each recorded verify and draft graph is replayed and
timed on the device; otherwise a few eager steps are timed on the host clock and the costs in between interpolated.
Runs before any request holds a block: the probes write their K/V into whatever blocks they name."""

from __future__ import annotations

import time

import torch

from ..draft_side import DraftSide
from ..drafter import DraftInput, Drafter
from ..request import Request
from ..sampling_params import SamplingParams
from ..target_side import TargetSide
from .step_costs import StepCosts

PROBE_CONTEXT = 128  # tokens of context behind each probed row
EAGER_BATCHES = (1, 8)  # batches timed eagerly (the costs between and beyond are interpolated)


def probe_costs(target: TargetSide, draft: Drafter | None, max_batch: int, reps: int = 3) -> StepCosts | None:
    """The step costs of this engine, or None when nothing can be measured (no local draft)."""
    if not isinstance(draft, DraftSide):
        return None
    n = draft.num_speculative_tokens
    graphs = target.graphs
    if graphs is not None and graphs.capture and draft.graphs is not None and draft.graphs.capture:
        verify, drafted = graphs.replay_costs(max_batch, reps), draft.graphs.replay_costs(max_batch, reps)
        if not verify or not drafted:  # nothing recorded yet (no warm-up): the policy waits for measurements
            return None
        return StepCosts(tuple((b, tuple(pts)) for b, pts in sorted(verify.items())),
                         tuple(drafted), staircase=True)
    verify, drafted = [], []
    for b in sorted({min(b, max_batch) for b in EAGER_BATCHES}):
        reqs = _probe_requests(target, b)
        pts = tuple((b * q, _time(lambda: target.run(reqs, [[1] * q] * b, last_only=False), reps))
                    for q in (1, 1 + n))
        verify.append((b, pts))
        drafted.append((b, _time(lambda: draft.propose(_probe_input(reqs, draft)), reps)))
    return StepCosts(tuple(verify), tuple(drafted), staircase=False)


def _probe_requests(target: TargetSide, b: int) -> list[Request]:
    width = -(-(PROBE_CONTEXT + 64) // target.block_size)
    reqs = []
    for i in range(b):
        r = Request(f"probe-{i}", [1], SamplingParams(max_tokens=1), 0, 0)
        r.target_blocks = r.draft_blocks = [(i * width + j) % target.num_blocks for j in range(width)]
        r.num_computed = PROBE_CONTEXT
        reqs.append(r)
    return reqs


def _probe_input(reqs: list[Request], draft: DraftSide) -> DraftInput:
    b = len(reqs)
    ints = torch.full((b,), PROBE_CONTEXT, dtype=torch.int64)
    return DraftInput(anchors=torch.ones(b, dtype=torch.int64), anchor_pos=ints, ctx_start=ints,
                      ctx_len=torch.zeros(b, dtype=torch.int64), features=None,
                      block_table=torch.tensor([r.draft_blocks for r in reqs]),
                      temperature=torch.zeros(b), seeds=torch.zeros(b, dtype=torch.int64))


def _time(fn, reps: int) -> float:
    """Milliseconds of fn() on the host clock (waiting for the device), the best of `reps` after a warm-up run."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best
