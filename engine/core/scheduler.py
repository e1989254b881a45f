"""The scheduler: plans each step (which requests decode and how many drafts they may verify, which prompt chunks
prefill) within a token budget, owns the KV blocks through the KVCacheManager, and commits each step's result.
It never touches a model: its tests run without one."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..grammar_state import advance_grammar
from ..request import FinishReason, Request, StepOutput
from .kv_manager import KVCacheManager
from .plan import DecodePlan, PrefillChunk, SchedulerOutput, StepResult
from .policy import PolicyView, SpecPolicy, cap_drafts, fixed_view


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once (decoding or prefilling)
    max_num_batched_tokens: int = 8192  # tokens one step processes: decode rows, verified drafts, prompt chunks
    eos_token_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be an int >= max_num_seqs ({self.max_num_seqs}), got "
                             f"{self.max_num_batched_tokens!r}")


@dataclass(frozen=True)
class DraftShape:
    """What the scheduler needs of the draft: its block, the cache slots a step's block takes, its cache size."""

    num_speculative_tokens: int
    query_len: int
    num_blocks: int


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, draft: DraftShape | None,
                 policy: SpecPolicy | None = None) -> None:
        cfg.validate()
        self.cfg, self.kv, self.draft, self.policy = cfg, kv, draft, policy
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: prefilling or decoding, oldest first
        self.num_preemptions = 0
        self._released: list[Request] = []
        self._fixed: dict = {}  # the last view of no policy

    @property
    def reserve(self) -> int:
        """Cache slots past a request's tokens kept for it: this step's verify and the next one, which the executor
        may launch before this one is committed, and the draft block chained behind that."""
        return reserve_slots(self.draft)

    def fits_alone(self, req: Request) -> bool:
        need = len(req.prompt_ids) + req.params.max_tokens + self.reserve
        return self.kv.fits_alone(need, need)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def set_draft(self, draft: DraftShape | None, policy: SpecPolicy | None) -> None:
        """A new draft (None: plain decoding): requests already here decode plainly (it has none of their context)."""
        for r in list(self.waiting) + self.running:
            self.kv.drop_draft(r)
            r.num_speculative_tokens = 0
        self.draft, self.policy = draft, policy
        self.kv.set_draft(draft.num_blocks if draft is not None else None)

    def abort(self, request_id: str) -> Request | None:
        """End a queued or running request now (its blocks are free at once); the request, or None."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = FinishReason.ABORT
                self._released.append(req)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                self._finish(req, FinishReason.ABORT)
                return req
        return None

    # -- planning -----------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        preempted = self.num_preemptions
        decode = self._plan_decode(budget)
        if decode is not None:
            budget -= len(decode.reqs) + decode.budget
        prefill = self._plan_prefill(budget, admit=self.num_preemptions == preempted)
        released, self._released = self._released, []
        return SchedulerOutput(decode, prefill, released)

    def _plan_decode(self, budget: int) -> DecodePlan | None:
        preempted = set()
        for req in list(self.running):  # every decoding request gets its next steps' cache slots, oldest first
            if req in preempted or not _decoding(req):
                continue
            while not self.kv.grow(req, *self._need(req)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim)
                if victim is req:
                    break
        reqs = [r for r in self.running if _decoding(r)]
        if not reqs:
            return None
        n = self.draft.num_speculative_tokens if self.draft is not None else 0
        caps = [cap_drafts(r.num_speculative_tokens, n, r.remaining) for r in reqs]
        pinned = [r.spec_pinned for r in reqs]
        view = self.policy.view(reqs, budget) if self.policy is not None and n else self._fixed_view(n, budget)
        return DecodePlan(reqs, caps, pinned, view.budget(reqs, caps, pinned), view)

    def _fixed_view(self, n: int, budget: int) -> PolicyView:
        key = (n, budget)
        if self._fixed.get("key") != key:
            self._fixed = {"key": key, "view": fixed_view(n, budget)}
        return self._fixed["view"]

    def _plan_prefill(self, budget: int, admit: bool) -> list[PrefillChunk]:
        """Chunks of the prompts already started, then new requests while the budget, max_num_seqs and the blocks
        allow (none in a step that had to preempt: they would take back the blocks just freed)."""
        chunks = []
        for req in self.running:  # prompts already started go on first
            if budget <= 0:
                break
            if not _decoding(req):
                chunks.append(self._chunk(req, budget))
                budget -= len(chunks[-1].tokens)
        while admit and self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.admit(req, _prefill_end(req), *self._need(req)):
                break
            self.waiting.popleft()
            self.running.append(req)
            if not req.output_ids:
                req.stats.queue_ms = 1e3 * (time.monotonic() - req.stats.arrival)
                req.stats.cached_tokens = req.num_cached_tokens
            if _decoding(req):  # everything before its last token was cached (a request preempted earlier)
                continue
            chunks.append(self._chunk(req, budget, first=True))
            budget -= len(chunks[-1].tokens)
        return chunks

    def _chunk(self, req: Request, budget: int, first: bool = False) -> PrefillChunk:
        """The next prompt chunk: after a preemption everything committed but the last token is recomputed."""
        end = _prefill_end(req)
        start = req.num_computed
        stop = min(end, start + budget)
        ids = req.prompt_ids[start:stop] if stop <= len(req.prompt_ids) else \
            (req.prompt_ids + req.output_ids)[start:stop]
        return PrefillChunk(req, start, ids, samples=not req.output_ids and stop == end, first=first)

    def _need(self, req: Request) -> tuple[int, int]:
        need = req.num_tokens + self.reserve
        return need, need

    def _preempt(self, victim: Request) -> None:
        """Free the newest request's blocks; it waits at the head of the queue to be recomputed (its tokens stay)."""
        self.num_preemptions += 1
        self.kv.free(victim)
        self.running.remove(victim)
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        self._released.append(victim)

    # -- committing ---------------------------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, result: StepResult) -> list[StepOutput]:
        """Commit a step: advance each request's cache, append its tokens up to the first stop, free the finished;
        -> every request's new tokens (and, once, its finish reason and stats)."""
        outputs = []
        now = time.monotonic()
        for chunk in plan.prefill:
            req = chunk.req
            req.num_computed = chunk.start + len(chunk.tokens)
            req.draft_context_len = (result.draft_context or {}).get(req, req.draft_context_len)
            self.kv.commit(req)
            if chunk.samples:
                token, logprobs = result.first_tokens[req]
                req.stats.first_token_ms = 1e3 * (now - req.stats.arrival)
                out = self._emit(req, [token], logprobs)
                scored = (result.prompt_logprobs or {}).get(req)
                outputs.append(out._replace(prompt_logprobs=scored) if scored is not None else out)
        if plan.decode is not None:
            rows = result.decoded
            if self.policy is not None:
                self.policy.stepped(result.drafted)
                self.policy.observe(plan.decode.reqs, [r.verified for r in rows], [r.accepted for r in rows],
                                    [r.confidences for r in rows])
            for req, row in zip(plan.decode.reqs, rows):
                req.num_computed += row.accepted + 1
                req.draft_context_len = row.draft_context
                _record(req, row.accepted, row.verified, result, self.draft)
                outputs.append(self._emit(req, row.tokens, row.logprobs))
                if not req.is_finished:
                    self.kv.commit(req)
        self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _emit(self, req: Request, tokens: list[int], logprobs: list[tuple] | None = None) -> StepOutput:
        """Append tokens up to the first stop; a stop inside an accepted run truncates it (and its logprobs).
        (Stop strings are the output processor's: it aborts the request when one appears.)"""
        n, reason = req.stop_in(tokens, self.eos_token_ids)
        req.output_ids.extend(tokens[:n])
        if reason is not None:
            self._finish(req, reason)
        advance_grammar(req, tokens[:n])
        return output_of(req, tokens[:n], logprobs[:n] if logprobs is not None else None)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.stats.finish_ms = 1e3 * (time.monotonic() - req.stats.arrival)
        self.kv.commit(req)  # what it computed stays cached for the next turn of its conversation
        self.kv.free(req)
        self._released.append(req)
        if self.policy is not None:
            self.policy.forget(req)


def reserve_slots(draft: DraftShape | None) -> int:
    if draft is None:
        return 2
    return 2 * (1 + draft.num_speculative_tokens) + draft.query_len


def output_of(req: Request, added: list[int], logprobs: list[tuple] | None = None) -> StepOutput:
    if req.finish_reason is None:
        return StepOutput(req.request_id, added, logprobs=logprobs)
    return StepOutput(req.request_id, added, req.finish_reason.value, req.stats.to_dict(), logprobs)


def _prefill_end(req: Request) -> int:
    """Positions a request's prefill computes: its prompt, or after a preemption every token but its last."""
    return len(req.prompt_ids) if not req.output_ids else req.num_tokens - 1


def _decoding(req: Request) -> bool:
    """Every committed token but the last (the anchor) is in the cache: the request takes decode steps."""
    return bool(req.output_ids) and req.num_computed == req.num_tokens - 1


def _record(req: Request, accepted: int, verified: int, result: StepResult, draft: DraftShape | None) -> None:
    s = req.stats
    s.steps += 1
    s.drafted += verified
    s.accepted += accepted
    s.accepted_per_step.append(accepted)
    s.verified_per_step.append(verified)
    n = draft.num_speculative_tokens if draft is not None else 0
    if len(s.per_position_accepted) < n:
        s.per_position_accepted.extend([0] * (n - len(s.per_position_accepted)))
    for i in range(accepted):
        s.per_position_accepted[i] += 1
    s.draft_ms += result.draft_ms
    s.verify_ms += result.verify_ms
    s.transfer_ms += result.transfer_ms
