"""A request's state across steps: committed tokens, cache positions, pending draft context, stats."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from .grammar_state import GrammarState
from .sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens
    ABORT = "abort"


@dataclass
class RequestStats:
    steps: int = 0  # verify steps (a plain decode step counts as one)
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, accepted
    accepted_per_step: list[int] = field(default_factory=list)
    verified_per_step: list[int] = field(default_factory=list)  # drafts verified each step (the chosen length)
    per_position_accepted: list[int] = field(default_factory=list)  # [num_speculative_tokens]
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    transfer_ms: float = 0.0
    arrival: float = 0.0  # time.monotonic() when the scheduler took the request
    queue_ms: float = 0.0  # arrival -> admitted
    first_token_ms: float = 0.0  # arrival -> first token
    finish_ms: float = 0.0  # arrival -> the step that finished it
    cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def tau(self) -> float:
        """Tokens per verify step, the bonus/correction token included."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "accepted_per_step": list(self.accepted_per_step),
                "verified_per_step": list(self.verified_per_step), "tau": self.tau,
                "per_position_accepted": list(self.per_position_accepted),
                "draft_ms": round(self.draft_ms, 3), "verify_ms": round(self.verify_ms, 3),
                "transfer_ms": round(self.transfer_ms, 3), "queue_ms": round(self.queue_ms, 3),
                "first_token_ms": round(self.first_token_ms, 3), "finish_ms": round(self.finish_ms, 3),
                "cached_tokens": self.cached_tokens}


@dataclass(eq=False)  # identity semantics: a live request is compared by object, never by its tensors
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    num_speculative_tokens: int  # this request's cap (0 = plain decoding)
    confidence_threshold: float | None = None  # overrides the server's dspark_confidence_threshold
    spec_pinned: bool = False  # the request fixed its number of drafts: every step verifies all it can
    output_ids: list[int] = field(default_factory=list)
    target_blocks: list[int] = field(default_factory=list)  # the KVCacheManager's to write
    draft_blocks: list[int] = field(default_factory=list)  # (the draft's context cache)
    num_computed: int = 0  # target K/V valid for positions [0, num_computed)
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache when admitted
    block_hashes: list = field(default_factory=list)  # chained hashes of its full blocks of tokens (prefix cache)
    registered_target: int = 0  # its target blocks registered in the prefix cache
    registered_draft: int = 0  # its draft blocks registered there
    draft_context_len: int = 0  # the draft's context K/V written for positions [0, this) (the executor's report)
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    banned_before_min: tuple[int, ...] = ()  # ids masked before min_tokens: EOS (unless ignore_eos), stop token ids
    prompt_mask: Tensor | None = None  # [V] bool on the device: the prompt's ids (repetition_penalty), made once
    grammar: GrammarState | None = None  # structured output: the grammar at the committed output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def anchor(self) -> int:
        """The last committed token: the target has not run it yet; the draft block starts from it."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def anchor_pos(self) -> int:
        return self.num_tokens - 1

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def stop_in(self, tokens: list[int], eos_token_ids: frozenset[int]) -> tuple[int, FinishReason | None]:
        """Appending `tokens`: how many it keeps (up to and including the first stop) and why it then finishes
        (None: it goes on). Stop strings are the output processor's."""
        p, have = self.params, len(self.output_ids)
        for n, tok in enumerate(tokens, 1):
            if (tok in eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                return n, FinishReason.STOP
            if have + n >= p.max_tokens:
                return n, FinishReason.LENGTH
        return len(tokens), None


class StepOutput(NamedTuple):
    """One request's part of one engine step: only its new tokens; the finish reason and stats once, at the
    end. A tuple, so that a step's outputs cross processes cheaply."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None
    logprobs: list[tuple] | None = None  # with SamplingParams.logprobs: per new token (id, logprob, [(id, logprob)])
    prompt_logprobs: list[tuple] | None = None  # with SamplingParams.prompt_logprobs, once: per prompt token
    # (id, logprob, [(id, logprob)], rank); the first token's logprob and rank are None (engine/prompt_logprobs.py)


@dataclass(frozen=True)
class RequestOutput:
    """What a caller of the in-process API sees: the whole output so far, and this step's new tokens and text."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stats: dict  # empty until the request finishes
    text_delta: str = ""
    logprobs: list[tuple] | None = None  # with SamplingParams.logprobs: per token_ids entry (id, logprob, top)
