"""StepCosts: what a step's parts cost in milliseconds, the verify by (requests, tokens) and the draft by requests,
as measured when the engine starts (engine/core/cost_probe.py). Monotone in every size."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

Points = tuple[tuple[int, float], ...]  # (size, ms), sizes increasing


def _monotone(points: Points) -> Points:
    out, top = [], 0.0
    for size, ms in sorted(points):
        top = max(top, ms)
        out.append((size, top))
    return tuple(out)


def _lookup(points: Points, size: int, staircase: bool) -> float:
    """The cost at `size`: on a staircase the smallest measured size >= it (a graph pads up to its bucket), else
    linear between the neighbours; past the last point, the last slope (or the last cost)."""
    sizes = [s for s, _ in points]
    i = bisect_left(sizes, size)
    if i < len(points) and (staircase or sizes[i] == size or i == 0):
        return points[i][1]
    if i == len(points):
        if len(points) == 1:
            return points[0][1] * size / max(points[0][0], 1)
        (s0, c0), (s1, c1) = points[-2], points[-1]
        return c1 + (c1 - c0) / (s1 - s0) * (size - s1)
    (s0, c0), (s1, c1) = points[i - 1], points[i]
    return c0 + (c1 - c0) * (size - s0) / (s1 - s0)


@dataclass(frozen=True)
class StepCosts:
    verify: tuple[tuple[int, Points], ...]  # (batch bucket, its (tokens, ms) points), buckets increasing
    draft: Points  # (requests, ms)
    staircase: bool = True  # sizes pad up to recorded graphs (else the points are samples of a smooth cost)

    def __post_init__(self) -> None:
        if not self.verify or not self.draft or any(not pts for _, pts in self.verify):
            raise ValueError("StepCosts needs at least one verify and one draft point")
        rows, top = [], ()
        for b, pts in sorted(self.verify):
            # a larger batch costs at least what a smaller one does at the same tokens, and more tokens no less
            pts = _monotone(tuple((s, max(ms, _lookup(top, s, self.staircase) if top and s <= top[-1][0] else 0.0))
                                  for s, ms in pts))
            rows.append((b, pts))
            top = pts
        object.__setattr__(self, "verify", tuple(rows))
        object.__setattr__(self, "draft", _monotone(self.draft))

    def bucket(self, num_reqs: int) -> int:
        """The verify table's batch bucket that num_reqs requests run in (the largest past the last)."""
        return next((b for b, _ in self.verify if b >= num_reqs), self.verify[-1][0])

    def verify_ms(self, num_reqs: int, num_tokens: int) -> float:
        row = next((pts for b, pts in self.verify if b >= num_reqs), self.verify[-1][1])
        return _lookup(row, num_tokens, self.staircase)

    def draft_ms(self, num_reqs: int) -> float:
        return _lookup(self.draft, num_reqs, self.staircase)

    def token_steps(self, num_reqs: int, max_tokens: int) -> list[int]:
        """The token counts worth comparing for `num_reqs` requests, up to max_tokens: on a staircase each
        step's top (more tokens within a step cost nothing), else every count (at most 64, evenly spread)."""
        if not self.staircase:
            span = max_tokens - num_reqs
            if span <= 64:
                return list(range(num_reqs, max_tokens + 1))
            return sorted({num_reqs + round(span * i / 64) for i in range(65)})
        row = next((pts for b, pts in self.verify if b >= num_reqs), self.verify[-1][1])
        tops = [s for s, _ in row if num_reqs <= s < max_tokens]
        return sorted(set(tops + [num_reqs, max_tokens]))

    @classmethod
    def linear(cls, fixed_ms: float, per_token_ms: float, draft_fixed_ms: float, draft_per_req_ms: float,
               max_batch: int = 256, max_tokens: int = 4096) -> StepCosts:
        """A smooth model: verify = fixed + per_token * tokens, draft = fixed + per_req * requests (tests, and
        devices where nothing was measured)."""
        pts = ((1, fixed_ms + per_token_ms), (max_tokens, fixed_ms + per_token_ms * max_tokens))
        return cls(((max_batch, pts),), ((1, draft_fixed_ms + draft_per_req_ms),
                                         (max_batch, draft_fixed_ms + draft_per_req_ms * max_batch)), False)

    def to_dict(self) -> dict:
        return {"verify": [[b, [list(p) for p in pts]] for b, pts in self.verify],
                "draft": [list(p) for p in self.draft], "staircase": self.staircase}

    @classmethod
    def from_dict(cls, d: dict) -> StepCosts:
        return cls(tuple((int(b), tuple((int(s), float(ms)) for s, ms in pts)) for b, pts in d["verify"]),
                   tuple((int(s), float(ms)) for s, ms in d["draft"]), bool(d.get("staircase", True)))
