"""Continuous batching: admit by free KV blocks, grow or preempt per step, prefill, speculate, stop, free."""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch

from .draft_side import DraftSide
from .rejection import verify_mixed
from .request import FinishReason, Request, RequestOutput
from .spec_config import SpeculativeConfig
from .spec_step import sampling_tensors, spec_step, verify_hints
from .target_side import TargetSide


class Scheduler:
    """Thread-safe: add/abort may be called while another thread runs step()."""

    def __init__(self, target: TargetSide, draft: DraftSide | None, spec: SpeculativeConfig, *,
                 max_num_seqs: int = 64, eos_token_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.target, self.draft, self.spec = target, draft, spec
        self.max_num_seqs, self.eos_token_ids, self.decode = max_num_seqs, set(eos_token_ids), decode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._lock = threading.RLock()

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
        need = len(req.prompt_ids) + req.params.max_tokens + self.lookahead + 1  # must fit when alone
        pools = [self.target.allocator] + ([self.draft.allocator] if self.draft is not None else [])
        if any(p.blocks_for(need) > p.num_blocks for p in pools):
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) "
                             f"does not fit the KV cache ({pools[0].num_blocks * pools[0].block_size} tokens)")
        with self._lock:
            self.waiting.append(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Free the request's blocks now; returns its final output (finish_reason "abort"), None if unknown."""
        with self._lock:
            for req in list(self.waiting):
                if req.request_id == request_id:
                    self.waiting.remove(req)
                    req.finish_reason = FinishReason.ABORT
                    return self._output(req, [])
            for req in self.running:
                if req.request_id == request_id:
                    self._finish(req, FinishReason.ABORT)
                    self.running.remove(req)
                    return self._output(req, [])
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        """Prefill what was admitted, then one speculative step for the requests already decoding (so a stream
        of arrivals cannot starve them)."""
        with self._lock:
            new = self._admit()
            outputs = self._prefill(new) if new else []
            if any(r not in new and not r.is_finished for r in self.running):
                self._make_room()
                decoding = [r for r in self.running if r not in new and not r.is_finished]
                if decoding:
                    outputs += self._decode(decoding)
            self.running = [r for r in self.running if not r.is_finished]
            return outputs

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
        return admitted

    def _make_room(self) -> None:
        """Every running request gets the blocks of its next step; when the pools run out the newest request is
        preempted: its blocks are freed and it waits at the head of the queue to be recomputed (its tokens stay)."""
        for req in list(self.running):
            while req in self.running and not self._grow(req):
                victim = self.running[-1]
                self.num_preemptions += 1
                self._release(victim)
                self.running.remove(victim)
                victim.num_computed = victim.draft_context_len = 0
                victim.pending_features, victim.last_survival = [], None
                self.waiting.appendleft(victim)

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request]) -> list[RequestOutput]:
        """Prompt (or, after preemption, every committed token but the anchor) through the target."""
        resumed = [r for r in reqs if r.output_ids]
        fresh = [r for r in reqs if not r.output_ids]
        if resumed:
            _, feats = self.target.run(resumed, [(r.prompt_ids + r.output_ids)[:-1] for r in resumed], last_only=True)
            for r, f in zip(resumed, feats):
                r.num_computed = r.num_tokens - 1
                if f is not None:
                    r.pending_features.append(f)
        return self._prefill_fresh(fresh) if fresh else []

    def _prefill_fresh(self, reqs: list[Request]) -> list[RequestOutput]:
        logits, feats = self.target.run(reqs, [r.prompt_ids for r in reqs], last_only=True)
        p = sampling_tensors(reqs, self.target.device)
        positions = torch.tensor([[len(r.prompt_ids)] for r in reqs], device=self.target.device)
        none = torch.zeros(len(reqs), 0, dtype=torch.int64, device=self.target.device)
        first = verify_mixed(none, torch.zeros(len(reqs), dtype=torch.int64, device=none.device), logits, None,
                             p["is_greedy"], p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"],
                             positions, **verify_hints(reqs)).output_tokens[:, 0].tolist()
        outputs = []
        for r, f, tok in zip(reqs, feats, first):
            r.num_computed = len(r.prompt_ids)
            if f is not None:
                r.pending_features.append(f)
            outputs.append(self._emit(r, [tok]))
        return outputs

    def _decode(self, reqs: list[Request]) -> list[RequestOutput]:
        result = spec_step(self.target, self.draft, reqs, self.spec)
        return [self._emit(r, toks) for r, toks in zip(reqs, result.new_tokens)]

    def _emit(self, req: Request, tokens: list[int]) -> RequestOutput:
        """Append tokens up to the first stop; a stop inside an accepted run truncates it."""
        added = []
        for tok in tokens:
            req.output_ids.append(tok)
            added.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
                break
        if self.decode is not None and not req.params.stop:
            req.output_text = self.decode(req.output_ids)
        return self._output(req, added)

    def _output(self, req: Request, added: list[int]) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_ids, list(req.output_ids), req.output_text, added,
                             req.is_finished, req.finish_reason.value if req.finish_reason else None,
                             req.stats.to_dict())

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        p = req.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self.decode is not None:
            text = self.decode(req.output_ids)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                req.output_text = text[:min(hits)]
                return FinishReason.STOP
            req.output_text = text
        if len(req.output_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._release(req)

    def _release(self, req: Request) -> None:
        self.target.allocator.free(req.target_blocks)
        req.target_blocks = []
        if self.draft is not None:
            self.draft.allocator.free(req.draft_blocks)
            req.draft_blocks = []
