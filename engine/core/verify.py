"""A verify step on the device: draft (or take the draft made ahead), choose how many drafts each row verifies,
queue the target's verify and the accept (launch), then read the accept and the rows' results (finish)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor
from torch.profiler import record_function

from ..drafter import DraftContext, DraftProposal, Drafter, draft_input
from ..logits_processing import StepLogprobs, process_logits, step_logprobs
from ..rejection import verify_greedy, verify_mixed
from ..request import Request
from ..spec_config import SpeculativeConfig
from ..target_side import TargetSide
from .pipeline import Launched, StepPipeline
from .plan import RowResult
from .policy import PolicyView, split_budget


def region(name: str):
    """A profiler region (bench_pair.py --profile) when a profiler runs; free otherwise."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else nullcontext()


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list on the device without a stream sync (a copy from pageable memory would wait for the GPU)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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

    def needs_confidences(self) -> bool:
        """Whether the split reads this step's confidences: the budget binds, or a threshold rule is on."""
        return self.budget < sum(self.caps) or self.survival_floor > 0 or any(t > 0 for t in self.thresholds)

    def split(self, proposal: DraftProposal | None) -> list[int]:
        """Drafts each row verifies (policy.split_budget on the host; a sync on the draft when it must read the
        confidences)."""
        if proposal is None or not self.drafts_wanted:
            return [0] * len(self.reqs)
        if not self.needs_confidences():
            return list(self.caps)
        logits = proposal.confidence_logits
        conf = torch.sigmoid(logits.float()).cpu() if logits is not None else None
        ratios = torch.tensor(self.view.ratios_for(self.reqs), dtype=torch.float32)
        return split_budget(conf, ratios, torch.tensor(self.caps), torch.tensor(self.pinned),
                            torch.tensor(self.budget), torch.tensor(self.thresholds), self.survival_floor).tolist()


def launch(target: TargetSide, draft: Drafter | None, rows: Rows, pipeline: StepPipeline,
           contexts: list[DraftContext], proposal: DraftProposal | None = None, anchors: list[int] | None = None,
           anchor_pos: list[int] | None = None, computed: list[int] | None = None,
           pending: list[list[int]] | None = None) -> Launched:
    """Draft (or take `proposal`, or the draft made ahead in `pipeline`), choose n, queue the verify and the
    accept; on the static path nothing here waits for the device unless the split reads confidences. anchors /
    anchor_pos / computed override the requests' own, and pending are the tokens committed before them (the next
    step, launched before this one is committed). Rows with penalties or min_tokens are verified on their
    processed logits, never in the graph."""
    reqs, dev = rows.reqs, target.device
    t0 = time.perf_counter()
    with region("dspark.draft"):  # the regions bench/bench_pair.py --profile reports
        if proposal is None and draft is not None and rows.drafts_wanted:
            proposal = pipeline.take_drafted(reqs) or draft.propose(
                draft_input(reqs, contexts, anchors, anchor_pos, computed))
    t1 = time.perf_counter()
    n = rows.split(proposal)
    drafts = proposal.tokens.to(dev) if proposal is not None else None
    with region("dspark.verify"):
        logits, feats, accept = target.verify(reqs, drafts, n, anchors, computed)
    hints = verify_hints(reqs)
    processed = any(r.params.processes_logits for r in reqs)
    if processed:
        logits = process_logits(reqs, logits, drafts, pending)
    conf = proposal.confidence_logits if proposal is not None else None
    if not hints["any_sampled"] and accept is not None and not processed:  # all greedy, verified in the graph
        lp = step_logprobs(reqs, logits, accept[:, 1:])
        return Launched(reqs, proposal, n, feats, accept, (t1 - t0) * 1e3, t1, logprobs=lp,
                        **_host_copy(accept, lp, conf))
    if drafts is None:
        drafts = torch.zeros(len(reqs), 0, dtype=torch.int64, device=dev)
    width = logits.shape[1] - 1
    with region("dspark.accept"):
        if hints["any_sampled"]:
            params = sampling_tensors(reqs, dev, anchor_pos)
            positions = params["anchor_pos"][:, None] + 1 + torch.arange(width + 1, device=dev)  # [R, width + 1]
            dense = proposal.dense_probs(target.vocab_size) if proposal is not None else None
            q = dense[:, :width].to(dev) if dense is not None else None
            result = verify_mixed(drafts[:, :width], to_device(n, torch.int64, dev), logits, q, params["is_greedy"],
                                  params["temperature"], params["top_k"], params["top_p"], params["min_p"],
                                  params["seeds"], positions, **hints)
        else:  # every row greedy: no sampling parameters, no q
            result = verify_greedy(drafts[:, :width], to_device(n, torch.int64, dev), logits)
        packed = torch.cat([result.num_accepted[:, None], result.output_tokens], 1)  # [R, 2 + width]
    lp = step_logprobs(reqs, logits, result.output_tokens)
    return Launched(reqs, proposal, n, feats, packed, (t1 - t0) * 1e3, t1, logprobs=lp,
                    **_host_copy(packed, lp, conf))


def _pinned(x: Tensor) -> Tensor:
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)


def _host_copy(packed: Tensor, logprobs: StepLogprobs | None, conf_logits: Tensor | None) -> dict:
    """Launched's host copies: on CUDA the accept (and the confidences, the logprobs) go to pinned memory as soon as
    the accept is computed, with an event."""
    conf = torch.sigmoid(conf_logits.float()) if conf_logits is not None else None
    if not packed.is_cuda:
        return {"conf_host": conf}
    host = _pinned(packed)
    lp_host = _pinned(logprobs.values) if logprobs is not None else None
    conf_host = _pinned(conf) if conf is not None else None
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
    for i in rows:
        r, a, k = launched.reqs[i], packed[i][0], launched.n[i]
        if context_of is not None and launched.feats[i] is not None:
            context_of(r).pending.append(launched.feats[i][:a + 1])
        tokens = packed[i][1:a + 2]
        out[r] = RowResult(tokens, a, k, conf[i] if conf is not None else None,
                           lp.of_row(lp_values, i, tokens) if lp is not None else None)
    return out
