"""Continuous batching: admit by free KV blocks, grow or preempt per step, prefill, speculate, stop, free."""

from __future__ import annotations

import threading
import time
from collections import deque
import torch

from .drafter import Drafter, DraftUnavailable
from .logits_processing import process_logits, step_logprobs
from .prompt_logprobs import prefill_fresh, with_prompt_logprobs
from .rejection import verify_mixed
from .request import FinishReason, Request, StepOutput
from .spec_config import SpeculativeConfig
from .spec_step import sampling_tensors, spec_step, verify_hints
from .step_pipeline import StepPipeline
from .target_side import TargetSide


class Scheduler:
    """add/abort may be called from any thread while another runs step(): they land in an inbox that step()
    applies before its work, so neither waits for a step."""

    def __init__(self, target: TargetSide, draft: Drafter | None, spec: SpeculativeConfig, *,
                 max_num_seqs: int = 64, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.target, self.draft, self.spec = target, draft, spec
        self.pipeline = StepPipeline(target.device, draft)  # what each step launches ahead for the next
        self.max_num_seqs, self.eos_token_ids = max_num_seqs, frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._lock = threading.Lock()  # step() and the inbox's consumer side
        self._inbox_lock = threading.Lock()
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()  # ids added and not yet finished

    @property
    def lookahead(self) -> int:
        """Slots past the last committed token one step may write: the verified drafts, or the draft block."""
        if self.draft is None:
            return 0
        return max(self.draft.num_speculative_tokens, self.draft.query_len - 1)

    def step_tokens(self, req: Request) -> int:
        """Cache slots the next step writes up to: the anchor plus a full draft block (+1 for a first token)."""
        return req.num_tokens + self.lookahead + 1 + (0 if req.output_ids else 1)

    def add(self, req: Request) -> None:
        """Queue a request; ValueError when it could never fit the KV cache, or its id is live."""
        need = len(req.prompt_ids) + req.params.max_tokens + self.lookahead + 1  # must fit when alone
        pools = self._pools()
        if any(p.blocks_for(need) > p.num_blocks for p in pools):
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) "
                             f"does not fit the KV cache ({pools[0].num_blocks * pools[0].block_size} tokens)")
        p = req.params
        if p.min_tokens > 0:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            req.banned_before_min = tuple(sorted(t for t in stops if t < self.target.vocab_size))
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
        return bool(self.waiting or self.running or self._adds or self._aborts)

    def live_ids(self) -> list[str]:
        """Ids queued or running (added and not yet finished)."""
        with self._inbox_lock:
            return list(self._live)

    def _apply_inbox(self) -> list[StepOutput]:
        with self._inbox_lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = set(self._aborts), []
        self.waiting.extend(r for r in adds if r.request_id not in aborts)
        outputs = [self._abort_output(r) for r in adds if r.request_id in aborts]
        if aborts:
            for req in [r for r in self.waiting if r.request_id in aborts]:
                self.waiting.remove(req)
                outputs.append(self._abort_output(req))
            for req in [r for r in self.running if r.request_id in aborts]:
                self._release(req)
                self.running.remove(req)
                outputs.append(self._abort_output(req))
        return outputs

    def _abort_output(self, req: Request) -> StepOutput:
        req.finish_reason = FinishReason.ABORT
        return self._output(req, [])

    def step(self) -> list[StepOutput]:
        """Apply the inbox, prefill what was admitted, then one speculative step for the requests already
        decoding (so a stream of arrivals cannot starve them). -> each request's new tokens of this step."""
        with self._lock:
            outputs = self._apply_inbox()
            new = self._admit()
            if new:
                outputs += self._prefill(new)
                self.running = [r for r in self.running if not r.is_finished]  # their blocks are free already
            decoding = [r for r in self.running if r not in new]
            if decoding:
                self._make_room()
                decoding = [r for r in self.running if r not in new]
                if decoding:
                    try:
                        outputs += self._decode(decoding)
                    except DraftUnavailable:  # the step again, plainly: greedy tokens are the same
                        self._drop_draft(None)
                        outputs += self._decode(decoding)
                self.running = [r for r in self.running if not r.is_finished]
            return outputs

    def set_draft(self, draft: Drafter | None) -> None:
        """Swap the draft between steps (None: plain decoding). Requests already queued or running decode plainly
        from here on: a new draft has none of their context."""
        with self._lock:
            self._drop_draft(draft)

    def _drop_draft(self, draft: Drafter | None) -> None:
        with self._inbox_lock:
            reqs = list(self.waiting) + self.running + self._adds
        for r in reqs:
            r.draft_blocks, r.pending_features, r.draft_context_len, r.last_survival = [], [], 0, None
            r.num_speculative_tokens = 0
        self.draft = draft
        self.pipeline.use_draft(draft)

    def _pools(self) -> list:
        return [self.target.allocator] + ([self.draft.allocator] if self.draft is not None else [])

    def _grow(self, req: Request) -> bool:
        """Give the request the blocks of its next step in every pool, or nothing if one pool is short."""
        need = self.step_tokens(req)
        extra = [(pool, blocks, pool.blocks_for(need) - len(blocks))
                 for pool, blocks in zip(self._pools(), (req.target_blocks, req.draft_blocks))]
        if any(n > pool.num_free for pool, _, n in extra):
            return False
        for pool, blocks, n in extra:
            if n > 0:
                blocks.extend(pool.allocate_blocks(n))
        return True

    def _admit(self) -> list[Request]:
        """Admission by free KV blocks: a request enters when its first step fits, and grows step by step."""
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            if not self._grow(self.waiting[0]):
                break
            req = self.waiting.popleft()
            self.running.append(req)
            admitted.append(req)
            if not req.output_ids:
                req.stats.queue_ms = 1e3 * (time.monotonic() - req.stats.arrival)
        return admitted

    def _make_room(self) -> None:
        """Every running request gets the blocks of its next step; when the pools run out the newest request is
        preempted: its blocks are freed and it waits at the head of the queue to be recomputed (its tokens stay)."""
        for req in list(self.running):
            while req in self.running and not req.is_finished and not self._grow(req):
                victim = self.running[-1]
                self.num_preemptions += 1
                self._release(victim)
                self.running.remove(victim)
                victim.num_computed = victim.draft_context_len = 0
                victim.pending_features, victim.last_survival = [], None
                self.waiting.appendleft(victim)

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request]) -> list[StepOutput]:
        """Prompt (or, after preemption, every committed token but the anchor) through the target."""
        resumed = [r for r in reqs if r.output_ids]
        fresh = [r for r in reqs if not r.output_ids]
        if resumed:
            _, feats = self.target.run(resumed, [(r.prompt_ids + r.output_ids)[:-1] for r in resumed], last_only=True)
            for r, f in zip(resumed, feats):
                r.num_computed = r.num_tokens - 1
                if f is not None and self.draft is not None:
                    r.pending_features.append(f)
        return self._prefill_fresh(fresh) if fresh else []

    def _prefill_fresh(self, reqs: list[Request]) -> list[StepOutput]:
        logits, feats, prompt_lps = prefill_fresh(self.target, reqs)
        logits = process_logits(reqs, logits, None)
        p = sampling_tensors(reqs, self.target.device)
        positions = torch.tensor([[len(r.prompt_ids)] for r in reqs], device=self.target.device)
        none = torch.zeros(len(reqs), 0, dtype=torch.int64, device=self.target.device)
        tokens = verify_mixed(none, torch.zeros(len(reqs), dtype=torch.int64, device=none.device), logits, None,
                              p["is_greedy"], p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"],
                              positions, **verify_hints(reqs)).output_tokens  # [R, 1]
        lp = step_logprobs(reqs, logits, tokens)
        lp_values = lp.values.tolist() if lp is not None else None
        first = tokens[:, 0].tolist()
        outputs, now = [], time.monotonic()
        for i, (r, f, tok) in enumerate(zip(reqs, feats, first)):
            r.stats.first_token_ms = 1e3 * (now - r.stats.arrival)
            r.num_computed = len(r.prompt_ids)
            if f is not None and self.draft is not None:
                r.pending_features.append(f)
            outputs.append(self._emit(r, [tok], lp.of_row(lp_values, i, [tok]) if lp is not None else None))
        return with_prompt_logprobs(outputs, prompt_lps)

    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        result = spec_step(self.target, self.draft, reqs, self.spec, self.pipeline)
        return [self._emit(r, toks, lps) for r, toks, lps in zip(reqs, result.new_tokens, result.logprobs)]

    def _emit(self, req: Request, tokens: list[int], logprobs: list[tuple] | None = None) -> StepOutput:
        """Append tokens up to the first stop; a stop inside an accepted run truncates it (and its logprobs).
        (Stop strings are the output processor's: it aborts the request when one appears.)"""
        p, n = req.params, 0
        for tok in tokens:
            req.output_ids.append(tok)
            n += 1
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(req, FinishReason.STOP)
                break
            if len(req.output_ids) >= p.max_tokens:
                self._finish(req, FinishReason.LENGTH)
                break
        return self._output(req, tokens[:n], logprobs[:n] if logprobs is not None else None)

    def _output(self, req: Request, added: list[int], logprobs: list[tuple] | None = None) -> StepOutput:
        if req.finish_reason is None:
            return StepOutput(req.request_id, added, logprobs=logprobs)
        with self._inbox_lock:
            self._live.discard(req.request_id)
        return StepOutput(req.request_id, added, req.finish_reason.value, req.stats.to_dict(), logprobs)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._release(req)

    def _release(self, req: Request) -> None:
        self.target.allocator.free(req.target_blocks)
        req.target_blocks = []
        if self.draft is not None:
            self.draft.allocator.free(req.draft_blocks)
            req.draft_blocks = []
