"""The speculative step, written once: propose -> choose how much to verify (verify_budget.py) -> verify -> commit;
then the next step is launched ahead into the scheduler's StepPipeline (engine/step_pipeline.py)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.profiler import record_function

from .drafter import DraftProposal, Drafter, draft_input
from .grammar_state import has_grammar
from .logits_processing import StepLogprobs, process_logits, step_logprobs
from .rejection import verify_greedy, verify_mixed
from .request import Request
from .spec_config import SpeculativeConfig
from .step_pipeline import Launched, StepPipeline
from .target_side import TargetSide
from .verify_budget import num_to_verify, reads_confidences, wanted


@dataclass(frozen=True)
class StepResult:
    new_tokens: list[list[int]]  # per request: accepted drafts + the correction/bonus token (before stop checks)
    num_accepted: list[int]
    num_drafted: list[int]
    logprobs: list[list[tuple] | None] | None = None  # per request, per new token (requests asking only)


def _region(name: str):
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


@torch.inference_mode()
def spec_step(target: TargetSide, draft: Drafter | None, reqs: list[Request], spec: SpeculativeConfig,
              pipeline: StepPipeline) -> StepResult:
    """One verify step for every running request; plain decoding when `draft` is None or nothing is drafted.
    Rows the previous step launched ahead (in `pipeline`) are finished as they are; the other requests are launched
    now. Before returning, the next step's draft and verify are launched ahead into `pipeline` where it is on."""
    max_drafts = draft.num_speculative_tokens if draft is not None else 0
    ahead, rows = pipeline.take_launched(reqs)
    rest = [r for r in reqs if r not in rows]
    fresh = _launch(target, draft, rest, spec, pipeline) if rest else None  # queued behind the rows launched ahead
    done: dict[Request, tuple[list[int], int, int, list[tuple] | None]] = {}
    if ahead is not None:
        done.update(_finish(ahead, sorted(rows.values()), max_drafts))
    if fresh is not None:
        done.update(_finish(fresh, range(len(rest)), max_drafts))
    new_tokens = [done[r][0] for r in reqs]
    if draft is not None and pipeline.draft_ahead:
        chained = pipeline.take_chained(ahead, rows, reqs)
        if chained is not None:  # queued on the device behind the verify just read
            pipeline.keep_drafted(reqs, _next_pos(reqs, new_tokens), chained)
        else:
            _draft_ahead(pipeline, draft, reqs, new_tokens, max_drafts)
    if pipeline.step_ahead:
        _step_ahead(pipeline, target, draft, reqs, new_tokens, spec, max_drafts)
    return StepResult(new_tokens, [done[r][1] for r in reqs], [done[r][2] for r in reqs], [done[r][3] for r in reqs])


def _launch(target: TargetSide, draft: Drafter | None, reqs: list[Request], spec: SpeculativeConfig,
            pipeline: StepPipeline, proposal: DraftProposal | None = None, anchors: list[int] | None = None,
            anchor_pos: list[int] | None = None, remaining: list[int] | None = None,
            pending: list[list[int]] | None = None) -> Launched:
    """Draft (or take `proposal`, or the draft made ahead in `pipeline`), choose n, queue the verify and the
    accept; on the static path nothing here waits for the device. anchors / anchor_pos / remaining override the
    requests' own, and pending are the tokens committed before them (the next step, launched before this one's
    tokens are appended). Rows with penalties or min_tokens are verified on their processed logits, never in the
    graph."""
    dev = target.device
    max_drafts = draft.num_speculative_tokens if draft is not None else 0
    t0 = time.perf_counter()
    with _region("dspark.draft"):  # the regions bench/bench_pair.py --profile reports
        if proposal is None and draft is not None and any(wanted(reqs, max_drafts, remaining)):
            proposal = pipeline.take_drafted(reqs) or draft.propose(draft_input(reqs, anchors, anchor_pos))
    t1 = time.perf_counter()
    n = num_to_verify(reqs, proposal, spec, max_drafts, remaining) if proposal is not None else [0] * len(reqs)
    drafts = proposal.tokens.to(dev) if proposal is not None else None
    with _region("dspark.verify"):
        logits, feats, accept = target.verify(reqs, drafts, n, anchors)
    hints = verify_hints(reqs)
    processed = any(r.params.processes_logits for r in reqs)
    if processed:
        logits = process_logits(reqs, logits, drafts, pending)
    if not hints["any_sampled"] and accept is not None and not processed:  # all greedy, verified in the graph
        lp = step_logprobs(reqs, logits, accept[:, 1:])
        return Launched(reqs, proposal, n, feats, accept, (t1 - t0) * 1e3, t1, logprobs=lp, **_host_copy(accept, lp))
    if drafts is None:
        drafts = torch.zeros(len(reqs), 0, dtype=torch.int64, device=dev)
    width = logits.shape[1] - 1
    with _region("dspark.accept"):
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
    return Launched(reqs, proposal, n, feats, packed, (t1 - t0) * 1e3, t1, logprobs=lp, **_host_copy(packed, lp))


def _pinned(x: Tensor) -> Tensor:
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)


def _host_copy(packed: Tensor, logprobs: StepLogprobs | None = None) -> dict:
    """Launched's host / ready (and logprobs_host): on CUDA the accept is copied to pinned memory as soon as it
    is computed."""
    if not packed.is_cuda:
        return {}
    host = _pinned(packed)
    lp_host = _pinned(logprobs.values) if logprobs is not None else None
    ready = torch.cuda.Event()
    ready.record()
    return {"host": host, "ready": ready, "logprobs_host": lp_host}


def _finish(launched: Launched, rows, max_drafts: int) -> dict[Request, tuple[list[int], int, int, list | None]]:
    """Read the accept counts (the step's host sync) and commit `rows` of the launch: request -> (its new tokens,
    accepted drafts, verified drafts, the new tokens' logprobs or None)."""
    lp = launched.logprobs
    with _region("dspark.accept"):
        if launched.ready is not None:
            launched.ready.synchronize()
        packed = (launched.host if launched.host is not None else launched.packed).tolist()
        lp_values = None if lp is None else \
            (launched.logprobs_host if launched.logprobs_host is not None else lp.values).tolist()
    t = time.perf_counter()
    out = {}
    for i in rows:
        r, a, k = launched.reqs[i], packed[i][0], launched.n[i]
        _commit_cache(r, a, launched.feats[i] if max_drafts else None)  # plain decoding keeps no draft context
        _record(r, a, k, launched.draft_ms, (t - launched.launched_at) * 1e3, max_drafts)
        r.stats.transfer_ms += launched.proposal.transfer_ms if launched.proposal is not None else 0.0
        tokens = packed[i][1:a + 2]
        out[r] = (tokens, a, k, lp.of_row(lp_values, i, tokens) if lp is not None else None)
    return out


def _step_ahead(pipeline: StepPipeline, target: TargetSide, draft: Drafter | None, reqs: list[Request],
                new_tokens: list[list[int]], spec: SpeculativeConfig, max_drafts: int) -> None:
    """Launch the next step's verify and accept now (pipeline.launched), from the tokens this step commits, so
    that the host's bookkeeping of this step (emitting tokens, stop checks, the scheduler) overlaps the device. A
    request's row is taken by the next step if it still decodes from the predicted state; otherwise (a stop, an
    abort, a preemption) the row is dropped, and what it wrote to the caches lies past the committed length
    (scratch). Not when choosing n needs this draft's confidences on the host, nor without the draft made ahead,
    nor for a batch with a grammar (its masks follow the committed tokens)."""
    pipeline.launched = None
    remaining = [r.remaining - len(t) for r, t in zip(reqs, new_tokens)]
    if max(remaining) <= 0:
        return
    want = wanted(reqs, max_drafts, remaining)
    pos = _next_pos(reqs, new_tokens)
    pool = target.allocator  # the verify writes the anchor and up to want[i] drafts past num_computed
    need = [max(0, pool.blocks_for(r.num_computed + 1 + k) - len(r.target_blocks)) for r, k in zip(reqs, want)]
    if sum(need) > pool.num_free or (any(want) and reads_confidences(reqs, spec, want)) or has_grammar(reqs):
        return
    proposal = None
    if draft is not None and any(want):
        proposal = pipeline.take_drafted(reqs, pos)
        if proposal is None:
            return
    for r, k in zip(reqs, need):
        r.target_blocks.extend(pool.allocate_blocks(k) if k else [])
    anchors = [t[-1] for t in new_tokens]
    launched = _launch(target, draft, reqs, spec, pipeline, proposal, anchors, pos, remaining, new_tokens)
    pipeline.launched = replace(launched, key=[(p, r.num_computed, a) for r, p, a in zip(reqs, pos, anchors)])
    if proposal is not None:
        pipeline.chain(draft, pos)


def _draft_ahead(pipeline: StepPipeline, draft: Drafter, reqs: list[Request], new_tokens: list[list[int]],
                 max_drafts: int) -> None:
    """Launch the next step's draft now (pipeline.drafted), from the tokens this step commits (the caller appends
    them later). It is used only if the next step's batch is these requests at the predicted positions (a stop, an
    abort, a preemption or an admission in between changes it; then the next step drafts afresh, and what this
    draft wrote to the draft cache is valid context or scratch)."""
    pipeline.drafted = None
    pos = _next_pos(reqs, new_tokens)
    if not any(wanted(reqs, max_drafts, [r.remaining - len(t) for r, t in zip(reqs, new_tokens)])):
        return
    pool = draft.allocator  # the next query block may need draft cache blocks the scheduler grows later
    need = [max(0, pool.blocks_for(p + draft.query_len) - len(r.draft_blocks)) for r, p in zip(reqs, pos)]
    if sum(need) > pool.num_free:
        return
    for r, k in zip(reqs, need):
        r.draft_blocks.extend(pool.allocate_blocks(k) if k else [])
    pipeline.keep_drafted(reqs, pos, draft.propose(draft_input(reqs, [t[-1] for t in new_tokens], pos)))


def _next_pos(reqs: list[Request], new_tokens: list[list[int]]) -> list[int]:
    """The next anchors' positions, before this step's tokens are appended."""
    return [r.num_tokens - 1 + len(t) for r, t in zip(reqs, new_tokens)]


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
