"""EngineCore: one engine step is schedule -> execute -> update. add/abort may be called from any thread while
another runs step(): they land in an inbox that step() applies before planning, so neither waits for a step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from ..drafter import Drafter
from ..request import FinishReason, Request, StepOutput
from .executor import Executor
from .policy import SpecPolicy
from .scheduler import DraftShape, Scheduler, output_of


def draft_shape(draft: Drafter | None) -> DraftShape | None:
    if draft is None:
        return None
    return DraftShape(draft.num_speculative_tokens, draft.query_len, draft.num_blocks)


class StepShape(NamedTuple):
    """What the last step did: its prompt chunks (requests, tokens, first tokens sampled) and decode rows (with the
    drafts they verified)."""

    prefill_reqs: int
    prefill_tokens: int
    first_tokens: int
    decode_rows: int
    verified: int


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, vocab_size: int,
                 make_policy: Callable[[Drafter | None], SpecPolicy | None] = lambda d: None) -> None:
        self.scheduler, self.executor, self.vocab_size = scheduler, executor, vocab_size
        self.make_policy = make_policy
        self._lock = threading.Lock()  # step() and the inbox's consumer side
        self._inbox_lock = threading.Lock()
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()  # ids added and not yet finished
        self._timing: tuple[float, tuple | None] | None = None  # the last step's start and its decode shape
        self._drafted = False  # whether the last decode step drafted
        self._last: tuple | None = None  # the last step's plan and result

    @property
    def kv(self):
        return self.scheduler.kv

    @property
    def draft(self) -> Drafter | None:
        return self.executor.draft

    def add(self, req: Request) -> None:
        """Queue a request; ValueError when it could never fit the KV cache, or its id is live."""
        if not self.scheduler.fits_alone(req):
            kv = self.scheduler.kv
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) "
                             f"does not fit the KV cache ({kv.target.num_blocks * kv.block_size} tokens)")
        p = req.params
        if p.min_tokens > 0:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.scheduler.eos_token_ids)
            req.banned_before_min = tuple(sorted(t for t in stops if t < self.vocab_size))
        with self._inbox_lock:
            if req.request_id in self._live:
                raise ValueError(f"request_id {req.request_id!r} is already running")
            self._live.add(req.request_id)
            req.stats.arrival = time.monotonic()
            self._adds.append(req)

    def abort(self, request_id: str) -> bool:
        """End the request before the next step's work (its final output, finish_reason "abort", comes out of
        that step); False when the id is not queued or running."""
        with self._inbox_lock:
            if request_id not in self._live:
                return False
            self._aborts.append(request_id)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._adds or self._aborts)

    def live_ids(self) -> list[str]:
        """Ids queued or running (added and not yet finished)."""
        with self._inbox_lock:
            return list(self._live)

    def step(self) -> list[StepOutput]:
        """Apply the inbox, plan the step, run it, commit it -> each request's new tokens of this step."""
        with self._lock:
            self._time_last_step()
            outputs = self._apply_inbox()
            plan = self.scheduler.schedule()
            result = self.executor.execute(plan)
            outputs += self.scheduler.update(plan, result)
            self._last = (plan, result)
            if result.draft_lost:
                self.scheduler.set_draft(None, None)
            self._forget([o for o in outputs if o.finish_reason is not None])
            d = plan.decode
            if d is not None and not plan.prefill and self.scheduler.has_unfinished():  # a pure decode step, more to come
                rows = result.decoded
                # a drafting step with pinned rows tells the host's time, not what the policy's budget yields
                emitted = None if result.drafted and any(d.pinned) else sum(r.accepted + 1 for r in rows)
                self._timing = (self._timing[0], (len(d.reqs), len(d.reqs) + sum(r.verified for r in rows),
                                                  result.drafted, result.drafted == self._drafted, emitted))
            self._drafted = result.drafted if d is not None else self._drafted
            return outputs

    @property
    def last_shape(self) -> StepShape | None:
        if self._last is None:
            return None
        plan, result = self._last
        return StepShape(len(plan.prefill), sum(len(c.tokens) for c in plan.prefill),
                         sum(c.samples for c in plan.prefill), len(plan.decode.reqs) if plan.decode else 0,
                         sum(r.verified for r in result.decoded))

    def _time_last_step(self) -> None:
        """The wall time from the last step's start to this one's goes to the policy (decode steps only)."""
        now = time.perf_counter()
        last, self._timing = self._timing, (now, None)
        if last is not None and last[1] is not None and self.scheduler.policy is not None:
            num_reqs, num_tokens, drafted, steady, emitted = last[1]
            self.scheduler.policy.timed(num_reqs, num_tokens, drafted, (now - last[0]) * 1e3, steady, emitted)

    def set_draft(self, draft: Drafter | None) -> None:
        """Swap the draft between steps (None: plain decoding). Requests already queued or running decode plainly
        from here on: a new draft has none of their context."""
        with self._lock:
            self.executor.set_draft(draft)
            self.scheduler.set_draft(draft_shape(draft), self.make_policy(draft))

    def _apply_inbox(self) -> list[StepOutput]:
        with self._inbox_lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = set(self._aborts), []
        outputs = []
        for req in adds:
            if req.request_id in aborts:
                req.finish_reason = FinishReason.ABORT
                outputs.append(output_of(req, []))
            else:
                self.scheduler.add(req)
        for rid in aborts:
            req = self.scheduler.abort(rid)
            if req is not None:
                outputs.append(output_of(req, []))
        return outputs

    def _forget(self, finished: list[StepOutput]) -> None:
        if finished:
            with self._inbox_lock:
                for o in finished:
                    self._live.discard(o.request_id)
