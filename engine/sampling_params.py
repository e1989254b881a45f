"""SamplingParams: one request's frozen sampling settings, validated once at the boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .structured_outputs import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # below this a request is decoded by argmax
MAX_LOGPROBS = 20  # top alternatives a request may ask for per token
MAX_N = 16  # sequences per request, unless the server sets another limit
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_BIAS = 100.0  # |bias| per token, as OpenAI's logit_bias
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0  # > 0; divides positive logits (multiplies negative) of prompt and output tokens
    presence_penalty: float = 0.0  # [-2, 2]; subtracted once from the logit of each token in the output so far
    frequency_penalty: float = 0.0  # [-2, 2]; subtracted per occurrence in the output so far
    min_tokens: int = 0  # EOS and stop token ids are not sampled, nor stop strings matched, before this many tokens
    logprobs: int | None = None  # each token's logprob and this many top alternatives (0..20); None: none
    skip_special_tokens: bool = True  # special tokens leave no text
    n: int = 1  # sequences per prompt (fanned out by the caller: one engine request each)
    structured_outputs: StructuredOutputsParams | None = None  # the output must match it (masks the target)
    prompt_logprobs: int | None = None  # each prompt token's logprob (raw target logits) and this many top (0..20)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the target's logits before penalties

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits change before this request samples from them (logit_bias, penalties,
        min_tokens, a grammar)."""
        return self.has_penalties or self.min_tokens > 0 or bool(self.logit_bias) or self.structured_outputs is not None

    def validate(self, max_tokens_limit: int | None = None, max_n: int = MAX_N) -> None:
        """Raise ValueError naming the first bad field, what it must be and what arrived."""
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed must be None or a 64-bit signed integer, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ValueError(f"max_tokens must be <= {max_tokens_limit} (the server limit), got {self.max_tokens}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a tuple of ints >= 0, got {ids!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {v!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {lp!r}")
        lp = self.prompt_logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], got {lp!r}")
        self._validate_logit_bias()
        if not _is_int(self.n) or not 1 <= self.n <= max_n:
            raise ValueError(f"n must be in [1, {max_n}], got {self.n!r}")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}")
            so.validate()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """The ids logit_bias names exist in a vocabulary of vocab_size (ValueError naming it)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad[:5]}")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be a tuple of at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
        for pair in bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                    and _is_number(pair[1]) and -MAX_BIAS <= pair[1] <= MAX_BIAS):
                raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                 f"got {pair!r}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
