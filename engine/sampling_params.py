"""SamplingParams: one request's frozen sampling settings, validated once at the boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_TEMPERATURE = 1e-5  # below this a request is decoded by argmax
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, max_tokens_limit: int | None = None) -> None:
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
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
