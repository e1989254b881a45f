"""The executor: runs a SchedulerOutput on the models and returns a StepResult. Prompt chunks go through the
target (their features join the draft's pending context); decode rows are drafted, trimmed to the plan's budget,
verified and accepted, with the next step launched ahead where the device allows (engine/core/pipeline.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..drafter import DraftContext, Drafter, DraftUnavailable, draft_input
from ..grammar_state import has_grammar
from ..host_copy import pinned_copy, to_device
from ..logits_processing import StepLogprobs, process_logits, step_logprobs
from ..prompt_logprobs import PROMPT_CHUNK_TOKENS, chunk_prompt_logprobs
from ..rejection import verify_mixed
from ..request import Request
from ..spec_config import SpeculativeConfig
from ..target_side import TargetSide
from .pipeline import ContextWriter, Launched, StepPipeline
from .plan import DecodePlan, PrefillChunk, RowResult, SchedulerOutput, StepResult
from .policy import cap_drafts
from .verify import Rows, finish, launch, sampling_tensors, verify_hints


@dataclass(frozen=True)
class FirstTokens:
    """The first output tokens a step's prefill sampled. On CUDA they go to pinned memory behind their own event, so
    that reading them waits for the prefill only, and the decode rows are launched before they are read."""

    reqs: list[Request]
    tokens: Tensor  # [R] (pinned on CUDA)
    logprobs: StepLogprobs | None
    values: Tensor | None  # logprobs.values (pinned on CUDA)
    ready: torch.cuda.Event | None

    @classmethod
    def of(cls, reqs: list[Request], tokens: Tensor, logprobs: StepLogprobs | None) -> FirstTokens:
        values = logprobs.values if logprobs is not None else None
        if not tokens.is_cuda:
            return cls(reqs, tokens, logprobs, values, None)
        host, values = pinned_copy(tokens), pinned_copy(values) if values is not None else None
        ready = torch.cuda.Event()
        ready.record()
        return cls(reqs, host, logprobs, values, ready)

    def read(self) -> dict[Request, tuple[int, list[tuple] | None]]:
        if self.ready is not None:
            self.ready.synchronize()
        values = self.values.tolist() if self.values is not None else None
        return {r: (tok, self.logprobs.of_row(values, i, [tok]) if self.logprobs is not None else None)
                for i, (r, tok) in enumerate(zip(self.reqs, self.tokens.tolist()))}


class Executor:
    def __init__(self, target: TargetSide, draft: Drafter | None, spec: SpeculativeConfig,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.target, self.draft, self.spec = target, draft, spec
        self.eos_token_ids = eos_token_ids  # a row that emits one (unless it ignores EOS) is not launched ahead
        self.pipeline = StepPipeline(target.device, draft)  # what each step launches ahead for the next
        self.contexts: dict[Request, DraftContext] = {}  # the draft's context of each running request
        self.prompt_logprobs: dict[Request, list[tuple]] = {}  # collected over a prompt's chunks, until its end
        self.draft_context: dict[Request, int] = {}  # this step's prompts' draft context written (for the cache)
        self._lost = False  # the draft stopped answering during the step

    def set_draft(self, draft: Drafter | None) -> None:
        """Swap the draft (None: plain decoding); nothing of the old one's context is kept."""
        self.draft = draft
        self.pipeline.use_draft(draft)
        self.contexts.clear()

    def _lose_draft(self) -> None:
        self._lost = True
        self.set_draft(None)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        for req in plan.released:
            self.contexts.pop(req, None)
            self.prompt_logprobs.pop(req, None)
        self.draft_context = {}
        first = self._prefill(plan.prefill) if plan.prefill else None  # read after the decode rows are launched
        scored = {c.req: self.prompt_logprobs.pop(c.req) for c in plan.prefill if c.samples and c.req in
                  self.prompt_logprobs}
        if plan.decode is None:
            return StepResult([], first.read() if first else {}, prompt_logprobs=scored,
                              draft_context=self.draft_context)
        self._lost = False
        try:
            rows, drafted, times = self._decode(plan.decode)
        except DraftUnavailable:  # the step again, plainly: greedy tokens are the same
            self._lose_draft()
            d = plan.decode
            rows, drafted, times = self._decode(replace(d, caps=[0] * len(d.reqs), budget=0))
        return StepResult(rows, first.read() if first else {}, self._lost, drafted, *times, prompt_logprobs=scored,
                          draft_context=self.draft_context)

    def _context(self, req: Request) -> DraftContext:
        ctx = self.contexts.get(req)
        if ctx is None:  # what the prefix cache gave the request is in the draft's cache already
            ctx = self.contexts[req] = DraftContext(req.draft_context_len)
        return ctx

    def _prefill(self, chunks: list[PrefillChunk]) -> FirstTokens | None:
        """Every chunk through the target at once; the chunks that end a fresh prompt sample its first token."""
        reqs = [c.req for c in chunks]
        scored = [i for i, c in enumerate(chunks) if c.req.params.prompt_logprobs is not None and not c.req.output_ids]
        if scored:  # their every position's logits: run on their own, a piece at a time
            rest = [i for i in range(len(chunks)) if i not in scored]
            rows, feats = [None] * len(chunks), [None] * len(chunks)
            if rest:
                lg, fs = self.target.run([reqs[i] for i in rest], [chunks[i].tokens for i in rest], last_only=True,
                                         starts=[chunks[i].start for i in rest])
                for k, i in enumerate(rest):
                    rows[i], feats[i] = lg[k], fs[k]
            for i in scored:
                rows[i], feats[i] = self._scored(chunks[i])
            logits = torch.stack(rows)  # [R, 1, V]
        else:
            logits, feats = self.target.run(reqs, [c.tokens for c in chunks], last_only=True,
                                            starts=[c.start for c in chunks])
        if self.draft is not None:
            for c, f in zip(chunks, feats):
                ctx = self._context(c.req)
                if c.first:  # what the prefix cache held is the draft's context too
                    ctx.reset(c.start)
                if f is not None:
                    ctx.pending.append((f, 0, f.shape[0]))
        self._write_contexts([c for c in chunks if c.samples])
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if not rows:
            return None
        sub = [reqs[i] for i in rows]
        logits = process_logits(sub, logits[rows] if len(rows) < len(reqs) else logits, None)
        dev = self.target.device
        p = sampling_tensors(sub, dev)
        positions = to_device([[len(r.prompt_ids)] for r in sub], torch.int64, dev)
        none = torch.zeros(len(sub), 0, dtype=torch.int64, device=dev)
        tokens = verify_mixed(none, torch.zeros(len(sub), dtype=torch.int64, device=dev), logits, None,
                              p["is_greedy"], p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"],
                              positions, **verify_hints(sub),
                              coupled=self.target.deterministic).output_tokens  # [R', 1]
        return FirstTokens.of(sub, tokens[:, 0], step_logprobs(sub, logits, tokens))

    def _write_contexts(self, chunks: list[PrefillChunk]) -> None:
        """Prompts just prefilled: their draft context written now (a local draft), so the prefix cache can hold it
        even for a request that never drafts; the next draft would write it anyway."""
        if not chunks or not isinstance(self.draft, ContextWriter):
            return
        reqs = [c.req for c in chunks]
        contexts = [self._context(r) for r in reqs]
        self.draft.write_context(draft_input(reqs, contexts, computed=[c.start + len(c.tokens) for c in chunks]))
        for r, c in zip(reqs, contexts):
            self.draft_context[r] = c.length

    def _scored(self, c: PrefillChunk) -> tuple[Tensor, Tensor | None]:
        """A prompt chunk of a request asking for prompt logprobs, PROMPT_CHUNK_TOKENS positions at a time with all
        their logits: its last position's logits [1, V] and features; its prompt logprobs collect in
        self.prompt_logprobs (the scheduler hands them out with its first token)."""
        req, entries, feats, last = c.req, self.prompt_logprobs.setdefault(c.req, []), [], None
        prompt = req.prompt_ids
        for s in range(c.start, c.start + len(c.tokens), PROMPT_CHUNK_TOKENS):
            tokens = prompt[s:min(s + PROMPT_CHUNK_TOKENS, c.start + len(c.tokens))]
            logits, f = self.target.run([req], [tokens], last_only=False, starts=[s])  # [1, >= T, V]
            nxt = prompt[s + len(tokens)] if s + len(tokens) < len(prompt) else None
            entries += chunk_prompt_logprobs(logits[0, :len(tokens)], tokens, nxt, req.params.prompt_logprobs,
                                             first=s == 0)
            feats.append(f[0])
            last = logits[0, len(tokens) - 1:len(tokens)]  # [1, V]
        return last, (torch.cat(feats) if feats[0] is not None else None)

    def _decode(self, plan: DecodePlan) -> tuple[list[RowResult], bool, tuple[float, float, float]]:
        """One verify step for the plan's rows. Rows the previous step launched ahead are finished as they are;
        the others are launched now, with the budget the view gives them. Then the next step is launched ahead."""
        reqs = plan.reqs
        index = {r: i for i, r in enumerate(reqs)}
        context_of = self._context if self.draft is not None else None
        ahead, taken = self.pipeline.take_launched(reqs)
        rest = [r for r in reqs if r not in taken]
        fresh = None
        if rest:
            caps = [plan.caps[index[r]] for r in rest]
            pinned = [plan.pinned[index[r]] for r in rest]
            budget = plan.budget if not taken else plan.view.budget(rest, caps, pinned)
            rows = Rows(rest, caps, pinned, budget, plan.view, self.spec)
            fresh = launch(self.target, self.draft, rows, self.pipeline, [self._context(r) for r in rest])
        done: dict[Request, RowResult] = {}
        if ahead is not None:
            done.update(finish(ahead, sorted(taken.values()), context_of))
        if fresh is not None:
            done.update(finish(fresh, range(len(rest)), context_of))
        results = [done[r] for r in reqs]
        launches = [x for x in (ahead, fresh) if x is not None]
        t = time.perf_counter()
        times = (sum(x.draft_ms for x in launches), max((t - x.launched_at) * 1e3 for x in launches),
                 sum(x.proposal.transfer_ms for x in launches if x.proposal is not None))
        try:
            self._next(plan, ahead, taken, [r.tokens for r in results])
        except DraftUnavailable:
            self._lose_draft()
        return results, any(x.proposal is not None for x in launches), times

    def _next(self, plan: DecodePlan, ahead: Launched | None, taken: dict[Request, int],
              new_tokens: list[list[int]]) -> None:
        """The next step's draft and verify, launched before the host commits this one, for the rows that go on
        (a row this step finishes is left out, so that a wave's tail keeps its launches and chained drafts)."""
        draft, pipeline = self.draft, self.pipeline
        n = draft.num_speculative_tokens if draft is not None else 0
        pos = [r.anchor_pos + len(t) for r, t in zip(plan.reqs, new_tokens)]  # the next anchors' positions
        computed = [r.num_computed + len(t) for r, t in zip(plan.reqs, new_tokens)]  # once this step is committed
        contexts = [self._context(r) for r in plan.reqs] if draft is not None else []
        chained = pipeline.take_chained(ahead, taken, plan.reqs, contexts, computed) \
            if draft is not None and pipeline.draft_ahead else None
        going = [i for i, (r, t) in enumerate(zip(plan.reqs, new_tokens))
                 if r.stop_in(t, self.eos_token_ids)[1] is None]
        if len(going) < len(plan.reqs):
            pick = lambda xs: [xs[i] for i in going]  # noqa: E731
            pos, computed, new_tokens = pick(pos), pick(computed), pick(new_tokens)
            contexts = pick(contexts) if contexts else []
            chained = chained.rows(going) if chained is not None and going else None
        reqs, pinned = [plan.reqs[i] for i in going], [plan.pinned[i] for i in going]
        pipeline.launched = None
        if not reqs:
            return
        caps = [cap_drafts(r.num_speculative_tokens, n, r.remaining - len(t)) for r, t in zip(reqs, new_tokens)]
        rows = Rows(reqs, caps, pinned, plan.view.budget(reqs, caps, pinned), plan.view, self.spec)
        anchors = [t[-1] for t in new_tokens]
        if draft is not None and pipeline.draft_ahead:
            if chained is not None:  # queued on the device behind the verify just read
                pipeline.keep_drafted(reqs, pos, computed, chained)
            elif rows.drafts_wanted and all(self._fits(p + draft.query_len, r.draft_blocks)
                                            for r, p in zip(reqs, pos)):
                pipeline.keep_drafted(reqs, pos, computed,
                                      draft.propose(draft_input(reqs, contexts, anchors, pos, computed)))
        if not pipeline.step_ahead or has_grammar(reqs):  # masks follow committed tokens
            return
        if not all(self._fits(c + 1 + k, r.target_blocks) for r, c, k in zip(reqs, computed, caps)):
            return
        proposal = None
        if rows.drafts_wanted:
            proposal = pipeline.take_drafted(reqs, pos, computed)
            if proposal is None:
                return
        launched = launch(self.target, draft, rows, pipeline, contexts, proposal, anchors, pos, computed, new_tokens)
        pipeline.launched = replace(launched, key=[(p, c, a) for p, c, a in zip(pos, computed, anchors)])
        if proposal is not None:
            pipeline.chain(draft, contexts, pos)

    def _fits(self, slots: int, blocks: list[int]) -> bool:
        """Whether `blocks` (the scheduler's reservation) hold cache slots [0, slots): both caches share the block
        size."""
        return -(-slots // self.target.block_size) <= len(blocks)

