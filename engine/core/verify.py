"""A verify step on the device: draft (or take the draft made ahead), choose how many drafts each row verifies,
queue the target's verify and the accept (launch), then read the accept and the rows' results (finish)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import Tensor
from torch.profiler import record_function

from ..drafter import DraftContext, DraftProposal, Drafter, draft_input
from ..host_copy import pinned_copy, to_device
from ..logits_processing import StepLogprobs, process_logits, step_logprobs
from ..draft_split import DraftSlots
from ..rejection import PACKED_ACCEPTED, PACKED_TOKENS, PACKED_VERIFIED, pack_accept, verify_mixed
from ..request import Request
from ..spec_config import SpeculativeConfig
from ..target_side import TargetSide, Verified
from .pipeline import Launched, StepPipeline
from .plan import RowResult
from .policy import PolicyView


def region(name: str):
    """A profiler region (bench_pair.py --profile) when a profiler runs; free otherwise."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else nullcontext()


def sampling_tensors(reqs: list[Request], device: torch.device,
                     anchor_pos: list[int] | None = None) -> dict[str, Tensor]:
    """Per-request parameters and anchor positions [R] (`anchor_pos` overrides the requests' own), in two
    host-to-device copies."""
    p = [r.params for r in reqs]
    floats = to_device([[x.temperature for x in p], [x.top_p for x in p], [x.min_p for x in p]], torch.float32, device)
    ints = to_device([[x.top_k for x in p], [r.seed for r in reqs], [int(x.is_greedy) for x in p],
                      [r.anchor_pos for r in reqs] if anchor_pos is None else anchor_pos], torch.int64, device)
    return {"temperature": floats[0], "top_p": floats[1], "min_p": floats[2], "top_k": ints[0], "seeds": ints[1],
            "is_greedy": ints[2].bool(), "anchor_pos": ints[3]}


def verify_hints(reqs: list[Request]) -> dict:
    """Host-side facts that let verification skip work: whether any row samples, which rows filter p."""
    return {"any_sampled": not all(r.params.is_greedy for r in reqs),
            "filtered_rows": [i for i, r in enumerate(reqs)
                              if r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0]}


class Rows:
    """The rows launched together and what bounds their drafts: caps, pins, the group's budget, the view."""

    def __init__(self, reqs: list[Request], caps: list[int], pinned: list[bool], budget: int, view: PolicyView,
                 spec: SpeculativeConfig) -> None:
        self.reqs, self.caps, self.pinned, self.budget, self.view = reqs, caps, pinned, budget, view
        self.thresholds = [spec.dspark_confidence_threshold if r.confidence_threshold is None
                           else r.confidence_threshold for r in reqs]
        self.survival_floor = spec.dspark_survival_threshold

    @property
    def drafts_wanted(self) -> bool:
        return self.budget > 0 and any(self.caps)

    def slots(self) -> DraftSlots:
        return DraftSlots(self.caps, self.pinned, self.budget if self.drafts_wanted else 0,
                          self.view.ratios_for(self.reqs), self.thresholds, self.survival_floor)


def launch(target: TargetSide, draft: Drafter | None, rows: Rows, pipeline: StepPipeline,
           contexts: list[DraftContext], proposal: DraftProposal | None = None, anchors: list[int] | None = None,
           anchor_pos: list[int] | None = None, computed: list[int] | None = None,
           pending: list[list[int]] | None = None) -> Launched:
    """Draft (or take `proposal`, or the draft made ahead in `pipeline`), queue the verify with its split of the
    budget and the accept; on the static path nothing here waits for the device. anchors / anchor_pos / computed
    override the requests' own, and pending are the tokens committed before them (the next step, launched before
    this one is committed). Rows that sample or process their logits are verified again on their own logits."""
    reqs, dev = rows.reqs, target.device
    t0 = time.perf_counter()
    with region("dspark.draft"):  # the regions bench/bench_pair.py --profile reports
        if proposal is None and draft is not None and rows.drafts_wanted:
            proposal = pipeline.take_drafted(reqs) or draft.propose(
                draft_input(reqs, contexts, anchors, anchor_pos, computed))
    t1 = time.perf_counter()
    drafts = proposal.tokens.to(dev) if proposal is not None else None
    logits = proposal.confidence_logits if proposal is not None else None
    conf = torch.sigmoid(logits.float()).to(dev) if logits is not None else None  # [R, N] c_k
    slots = rows.slots() if proposal is not None else replace(rows.slots(), budget=0)
    with region("dspark.verify"):
        v = target.verify(reqs, slots, drafts, conf, anchors, computed)
    packed = v.packed
    again = [i for i, r in enumerate(reqs) if not r.params.is_greedy or r.params.processes_logits]
    asking = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    lp = None
    if again or asking:
        with region("dspark.accept"):
            lp = _verify_again(target, reqs, v, again, asking, drafts, proposal, anchor_pos, pending)
    return Launched(reqs, proposal, rows.caps, v.feats, packed, (t1 - t0) * 1e3, t1, logprobs=lp,
                    **_host_copy(packed, lp, conf))


def _verify_again(target: TargetSide, reqs: list[Request], v: Verified, again: list[int], asking: list[int],
                  drafts: Tensor | None, proposal: DraftProposal | None, anchor_pos: list[int] | None,
                  pending: list[list[int]] | None) -> StepLogprobs | None:
    """The rows that sample or process their logits, verified on their own processed logits (their packed rows
    replaced in place), and the logprobs of the rows that ask for them."""
    dev, width = target.device, v.width
    rows = sorted(set(again) | set(asking))
    sub = [reqs[i] for i in rows]
    logits = v.logits_of(rows)  # [R', 1 + W, V]
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    d = drafts[idx, :width] if drafts is not None else torch.zeros(len(rows), width, dtype=torch.int64, device=dev)
    if any(r.params.processes_logits for r in sub):
        logits = process_logits(sub, logits, d, [pending[i] for i in rows] if pending is not None else None)
    if again:
        hints = verify_hints(sub)
        params = sampling_tensors(sub, dev, [anchor_pos[i] for i in rows] if anchor_pos is not None else None)
        positions = params["anchor_pos"][:, None] + 1 + torch.arange(width + 1, device=dev)  # [R', W + 1]
        dense = proposal.dense_probs(target.vocab_size) if proposal is not None and hints["any_sampled"] else None
        q = dense[idx, :width].to(dev) if dense is not None else None
        num = v.packed[idx, PACKED_VERIFIED]
        result = verify_mixed(d, num, logits, q, params["is_greedy"], params["temperature"], params["top_k"],
                              params["top_p"], params["min_p"], params["seeds"], positions, **hints,
                              coupled=target.deterministic)
        redo = [j for j, i in enumerate(rows) if i in set(again)]
        keep = torch.tensor(redo, dtype=torch.int64, device=dev)
        v.packed.index_copy_(0, idx[keep], pack_accept(num, result)[keep])
    lp = step_logprobs(sub, logits, v.packed[idx, PACKED_TOKENS:])
    if lp is None:
        return None
    return replace(lp, rows=[rows[j] for j in lp.rows])


def _host_copy(packed: Tensor, logprobs: StepLogprobs | None, conf: Tensor | None) -> dict:
    """Launched's host copies: on CUDA the accept (and the confidences, the logprobs) go to pinned memory as soon as
    the accept is computed, with an event."""
    if not packed.is_cuda:
        return {"conf_host": conf}
    host = pinned_copy(packed)
    lp_host = pinned_copy(logprobs.values) if logprobs is not None else None
    conf_host = pinned_copy(conf) if conf is not None else None
    ready = torch.cuda.Event()
    ready.record()
    return {"host": host, "ready": ready, "logprobs_host": lp_host, "conf_host": conf_host}


def finish(launched: Launched, rows, context_of: Callable[[Request], DraftContext] | None
           ) -> dict[Request, RowResult]:
    """Read the accept (the step's host sync) and the results of `rows` of the launch: request -> RowResult. The
    features of each row's anchor and accepted drafts join its pending draft context (when `context_of`)."""
    lp = launched.logprobs
    with region("dspark.accept"):
        if launched.ready is not None:
            launched.ready.synchronize()
        packed = (launched.host if launched.host is not None else launched.packed).tolist()
        lp_values = None if lp is None else \
            (launched.logprobs_host if launched.logprobs_host is not None else lp.values).tolist()
        conf = launched.conf_host.tolist() if launched.conf_host is not None else None
    out = {}
    feats = launched.feats.flatten(0, 1) if launched.feats is not None else None  # [R * (1 + W), F]
    width = launched.feats.shape[1] if feats is not None else 0
    for i in rows:
        r, row = launched.reqs[i], packed[i]
        k, a = row[PACKED_VERIFIED], row[PACKED_ACCEPTED]
        if context_of is not None and feats is not None:
            context_of(r).pending.append((feats, i * width, a + 1))
        tokens = row[PACKED_TOKENS:PACKED_TOKENS + a + 1]
        out[r] = RowResult(tokens, a, k, conf[i] if conf is not None else None,
                           lp.of_row(lp_values, i, tokens) if lp is not None else None,
                           context_of(r).length if context_of is not None else 0)
    return out
