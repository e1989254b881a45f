"""The speculative step, written once: propose -> choose how much to verify -> verify -> commit."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.profiler import record_function

from .draft_side import DraftProposal, DraftSide, draft_input
from .rejection import verify_greedy, verify_mixed
from .request import Request
from .spec_config import SpeculativeConfig
from .target_side import TargetSide


@dataclass(frozen=True)
class StepResult:
    new_tokens: list[list[int]]  # per request: accepted drafts + the correction/bonus token (before stop checks)
    num_accepted: list[int]
    num_drafted: list[int]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list on the device without a stream sync (a copy from pageable memory would wait for the GPU)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def sampling_tensors(reqs: list[Request], device: torch.device) -> dict[str, Tensor]:
    """Per-request parameters and anchor positions [R], in two host-to-device copies."""
    p = [r.params for r in reqs]
    floats = to_device([[x.temperature for x in p], [x.top_p for x in p], [x.min_p for x in p]], torch.float32, device)
    ints = to_device([[x.top_k for x in p], [r.seed for r in reqs], [int(x.is_greedy) for x in p],
                      [r.anchor_pos for r in reqs]], torch.int64, device)
    return {"temperature": floats[0], "top_p": floats[1], "min_p": floats[2], "top_k": ints[0], "seeds": ints[1],
            "is_greedy": ints[2].bool(), "anchor_pos": ints[3]}


def verify_hints(reqs: list[Request]) -> dict:
    """Host-side facts that let verification skip work: whether any row samples, which rows filter p."""
    return {"any_sampled": not all(r.params.is_greedy for r in reqs),
            "filtered_rows": [i for i, r in enumerate(reqs)
                              if r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0]}


def num_to_verify(reqs: list[Request], proposal: DraftProposal | None, spec: SpeculativeConfig,
                  max_drafts: int) -> list[int]:
    """Drafts verified per request; each cut depends only on what is known before that draft is drawn.

    Threshold: c_k depends on h_k and the previous draft only, so survival prod_{i<=k} c_i >= t decides on
    draft k without looking at it. Budget: the capacity comes from the previous step's survival (stale).
    Token cap: the step verifies at most dspark_max_verify_tokens drafts, the most likely to survive first.
    """
    n = [max(0, min(r.num_speculative_tokens, max_drafts, r.remaining - 1)) for r in reqs]
    thresholds = [spec.dspark_confidence_threshold if r.confidence_threshold is None else r.confidence_threshold
                  for r in reqs]
    cap = spec.dspark_max_verify_tokens
    capped = 0 < cap < sum(n)
    has_conf = proposal is not None and proposal.confidence_logits is not None
    if not has_conf or (spec.dspark_budget_frac <= 0 and not any(t > 0 for t in thresholds) and not capped):
        return _cap_tokens(n, None, cap) if capped else n  # no device -> host read of the confidences
    survival = torch.sigmoid(proposal.confidence_logits).cumprod(-1).cpu()  # [R, N]
    if any(t > 0 for t in thresholds):
        confident = (survival >= torch.tensor(thresholds)[:, None]).sum(-1).tolist()
        n = [min(a, b) for a, b in zip(n, confident)]
    if spec.dspark_budget_frac > 0:
        n = [min(a, b) for a, b in zip(n, _budget_capacity(reqs, spec.dspark_budget_frac, max_drafts))]
    for r, s in zip(reqs, survival):
        r.last_survival = s
    return _cap_tokens(n, survival, cap) if 0 < cap < sum(n) else n


def _cap_tokens(n: list[int], survival: Tensor | None, cap: int) -> list[int]:
    """Keep the `cap` slots (request r, draft k < n[r]) ranked by survival [R, N] (or by k without it); ties go to
    the earlier draft, so a slot's fate depends on its own prefix and other requests only: each row keeps a prefix."""
    s = survival.tolist() if survival is not None else None
    slots = [(-(s[r][k] if s is not None else 0.0), k, r) for r, m in enumerate(n) for k in range(m)]
    keep = [0] * len(n)
    for _, _, r in sorted(slots)[:cap]:
        keep[r] += 1
    return keep


def _budget_capacity(reqs: list[Request], frac: float, max_drafts: int) -> list[int]:
    known = [r.last_survival for r in reqs if r.last_survival is not None]
    if not known:
        return [max_drafts] * len(reqs)
    budget = int(len(reqs) * max_drafts * frac) + 1
    flat = torch.cat([s if s is not None else torch.ones(max_drafts) for s in (r.last_survival for r in reqs)])
    owner = torch.arange(len(reqs)).repeat_interleave(max_drafts)
    top = flat.topk(min(budget, flat.numel())).indices
    return torch.bincount(owner[top], minlength=len(reqs)).tolist()


@torch.inference_mode()
def spec_step(target: TargetSide, draft: DraftSide | None, reqs: list[Request], spec: SpeculativeConfig) -> StepResult:
    """One verify step for every running request; plain decoding when `draft` is None or nothing is drafted."""
    dev = target.device
    hints = verify_hints(reqs)
    max_drafts = draft.num_speculative_tokens if draft is not None else 0
    want = [max(0, min(r.num_speculative_tokens, max_drafts, r.remaining - 1)) for r in reqs]
    t0 = time.perf_counter()
    proposal = None
    with record_function("dspark.draft"):  # the regions bench/bench_pair.py --profile reports
        if draft is not None and any(want):
            proposal = _drafted_ahead(draft, reqs) or draft.propose(draft_input(reqs))
    t1 = time.perf_counter()
    n = num_to_verify(reqs, proposal, spec, max_drafts) if proposal is not None else [0] * len(reqs)
    drafts = proposal.tokens.to(dev) if proposal is not None else None
    with record_function("dspark.verify"):
        logits, feats = target.verify(reqs, drafts, n)
    if drafts is None:
        drafts = torch.zeros(len(reqs), 0, dtype=torch.int64, device=dev)
    width = logits.shape[1] - 1
    with record_function("dspark.accept"):
        if hints["any_sampled"]:
            params = sampling_tensors(reqs, dev)
            positions = params["anchor_pos"][:, None] + 1 + torch.arange(width + 1, device=dev)  # [R, width + 1]
            dense = proposal.dense_probs(target.vocab_size) if proposal is not None else None
            q = dense[:, :width].to(dev) if dense is not None else None
            result = verify_mixed(drafts[:, :width], to_device(n, torch.int64, dev), logits, q, params["is_greedy"],
                                  params["temperature"], params["top_k"], params["top_p"], params["min_p"],
                                  params["seeds"], positions, **hints)
        else:  # every row greedy: no sampling parameters, no q
            result = verify_greedy(drafts[:, :width], to_device(n, torch.int64, dev), logits)
        packed = torch.cat([result.num_accepted[:, None], result.output_tokens], 1).tolist()  # the step's host sync
    accepted, out_tokens = [row[0] for row in packed], [row[1:] for row in packed]
    t2 = time.perf_counter()
    new_tokens = []
    for r, a, k, f, toks in zip(reqs, accepted, n, feats, out_tokens):
        _commit_cache(r, a, f)
        _record(r, a, k, (t1 - t0) * 1e3, (t2 - t1) * 1e3, max_drafts)
        r.stats.transfer_ms += proposal.transfer_ms if proposal is not None else 0.0
        new_tokens.append(toks[:a + 1])
    if getattr(draft, "draft_ahead", False):
        _draft_ahead(draft, reqs, new_tokens, max_drafts)
    return StepResult(new_tokens, accepted, n)


def _draft_ahead(draft: DraftSide, reqs: list[Request], new_tokens: list[list[int]], max_drafts: int) -> None:
    """Launch the next step's draft now, from the tokens this step commits (the caller appends them later). It is
    used only if the next step's batch is these requests at the predicted positions (a stop, an abort, a
    preemption or an admission in between changes it; then the next step drafts afresh, and what this draft
    wrote to the draft cache is valid context or scratch)."""
    draft.ahead = None
    pos = [r.num_tokens - 1 + len(t) for r, t in zip(reqs, new_tokens)]  # the next anchors' positions
    if not any(min(r.num_speculative_tokens, max_drafts, r.remaining - len(t) - 1) > 0
               for r, t in zip(reqs, new_tokens)):
        return
    pool = draft.allocator  # the next query block may need draft cache blocks the scheduler grows later
    need = [max(0, pool.blocks_for(p + draft.query_len) - len(r.draft_blocks)) for r, p in zip(reqs, pos)]
    if sum(need) > pool.num_free:
        return
    for r, k in zip(reqs, need):
        r.draft_blocks.extend(pool.allocate_blocks(k) if k else [])
    key = [(r, p, r.num_computed) for r, p in zip(reqs, pos)]
    draft.ahead = (key, draft.propose(draft_input(reqs, [t[-1] for t in new_tokens], pos)))


def _drafted_ahead(draft: DraftSide, reqs: list[Request]) -> DraftProposal | None:
    """The proposal drafted ahead at the end of the previous step, if it was drafted for exactly this batch."""
    ahead = getattr(draft, "ahead", None)
    if ahead is None:
        return None
    draft.ahead = None
    key, proposal = ahead
    if len(key) != len(reqs) or any(r is not k or r.anchor_pos != p or r.num_computed != c
                                     for r, (k, p, c) in zip(reqs, key)):
        return None
    return proposal


def _commit_cache(r: Request, accepted: int, features: Tensor | None) -> None:
    """Keep the anchor and the accepted drafts: the rest is rolled back by length, without copies."""
    r.num_computed += accepted + 1
    if features is not None:
        r.pending_features.append(features[:accepted + 1])


def _record(r: Request, accepted: int, drafted: int, draft_ms: float, verify_ms: float, max_drafts: int) -> None:
    s = r.stats
    s.steps += 1
    s.drafted += drafted
    s.accepted += accepted
    s.accepted_per_step.append(accepted)
    if len(s.per_position_accepted) < max_drafts:
        s.per_position_accepted.extend([0] * (max_drafts - len(s.per_position_accepted)))
    for i in range(accepted):
        s.per_position_accepted[i] += 1
    s.draft_ms += draft_ms
    s.verify_ms += verify_ms
