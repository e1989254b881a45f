"""What the scheduler hands the executor for one step (SchedulerOutput) and what comes back (StepResult)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request
from .policy import PolicyView


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, start + len(tokens)) of a request's prompt (after a preemption: of everything it committed
    but its last token) written to the target's cache this step."""

    req: Request
    start: int
    tokens: list[int]
    samples: bool  # the last chunk of a fresh prompt: its last position's logits give the first output token
    first: bool = False  # the request's first chunk since admitted: the cache before `start` was found cached


@dataclass(frozen=True)
class DecodePlan:
    """The requests taking a decode/verify step. Each may verify up to caps[i] of its drafts; the `budget` draft
    slots of the step go to the likeliest ones (policy.split_budget), pinned rows first."""

    reqs: list[Request]
    caps: list[int]  # drafts each request may verify (0: a plain row)
    pinned: list[bool]  # the request fixed its own number of drafts: all caps[i] are verified
    budget: int  # draft slots verified in all (sum(caps): every cap; 0: no draft runs)
    view: PolicyView  # the policy's state this step was sized from; also sizes a step launched ahead


@dataclass(frozen=True)
class SchedulerOutput:
    decode: DecodePlan | None
    prefill: list[PrefillChunk]
    released: list[Request] = field(default_factory=list)  # finished, aborted or preempted since the last plan

    @property
    def num_tokens(self) -> int:
        """Tokens the step processes at most: decode rows and their verified drafts, and the prompt chunks."""
        d = self.decode
        return (len(d.reqs) + d.budget if d is not None else 0) + sum(len(c.tokens) for c in self.prefill)

    @property
    def empty(self) -> bool:
        return self.decode is None and not self.prefill


@dataclass(frozen=True)
class RowResult:
    """One decode row's outcome: its new tokens (the accepted drafts, then the correction or bonus token), how
    many drafts were verified and accepted, and the draft's conditional confidences c_k (None without a draft or
    a confidence head) that the policy compares with what was accepted."""

    tokens: list[int]
    accepted: int
    verified: int
    confidences: list[float] | None = None  # [N]
    logprobs: list[tuple] | None = None
    draft_context: int = 0  # the draft's context K/V written for positions [0, this) (for the prefix cache)


@dataclass(frozen=True)
class StepResult:
    decoded: list[RowResult]  # aligned with plan.decode.reqs
    first_tokens: dict[Request, tuple[int, list[tuple] | None]]  # prompts finished this step: token, its logprobs
    draft_lost: bool = False  # the draft stopped answering: the step was redone plainly and the draft is gone
    drafted: bool = False  # a draft ran for this step's rows
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    transfer_ms: float = 0.0
    draft_context: dict | None = None  # Request -> the draft context written for its prompt this step
    prompt_logprobs: dict | None = None  # Request -> its prompt logprobs (engine/prompt_logprobs.py), with its first token
