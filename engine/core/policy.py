"""Load-adaptive speculation: how many of its drafts each request verifies this step.

Survival of draft slot k is the chance that drafts 0..k are all accepted: the running product of the drafter's
conditional confidences c_0..c_k, each corrected by the acceptance measured online at its position (per request,
shrunk towards the server-wide estimate; without a confidence head the online estimate alone). The scheduler
sizes the step's budget B of verified drafts from what is known before the step's drafts exist (the survivals of
each request's previous step) and the measured step costs, maximising expected tokens per millisecond; the executor
then gives B to the slots with the highest survivals across the batch (engine/draft_split.py, on the device).

Lossless: whether slot k is verified depends on c_0..c_k (which depend on the drafts before k, never on draft k),
on slots of other requests, and on the past; never on draft k itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..draft_split import MAX_COND
from .step_costs import StepCosts

if TYPE_CHECKING:
    from ..request import Request

PRIOR_WEIGHT = 4.0  # pseudo-observations of the server-wide correction behind each request's own
DECAY = 0.97  # weight of older observations per new one, so the estimates follow a changing text
NO_HEAD_PRIOR = 0.6  # conditional acceptance assumed per position before anything is measured (no confidence head)
EXPLORE_EVERY = 16  # steps without a draft after which one drafts anyway, so the estimates keep up with the text


def cap_drafts(pinned_or_default: int, max_drafts: int, remaining: int) -> int:
    """Drafts a request can use in a step: its own cap, the draft's block, and its remaining tokens minus the
    correction/bonus token."""
    return max(0, min(pinned_or_default, max_drafts, remaining - 1))


@dataclass
class _Counts:
    """Per draft position: decayed counts of slots reached (every earlier draft accepted, this one verified),
    of those accepted, and the sum of their predicted c_k."""

    reached: list[float]
    accepted: list[float]
    predicted: list[float]

    @classmethod
    def prior(cls, n: int, weight: float, accept: float, predicted: float) -> _Counts:
        return cls([weight] * n, [weight * accept] * n, [weight * predicted] * n)

    def observe(self, verified: int, accepted: int, conf: list[float] | None) -> None:
        for k in range(min(accepted + 1, verified)):
            self.reached[k] = self.reached[k] * DECAY + 1.0
            self.accepted[k] = self.accepted[k] * DECAY + (1.0 if k < accepted else 0.0)
            self.predicted[k] = self.predicted[k] * DECAY + (conf[k] if conf is not None else 1.0)


@dataclass(frozen=True)
class PolicyView:
    """What the budget of a step is sized from, fixed when it is planned; the executor sizes a step it launches
    ahead from the same view."""

    enabled: bool
    num_drafts: int  # N, the draft's block
    costs: StepCosts | None
    ratios: dict  # Request -> [N] online correction of its c_k
    survival: dict  # Request -> [N] expected survival of its next slots
    default_ratio: tuple[float, ...]
    default_survival: tuple[float, ...]
    max_verify_tokens: int = 0  # > 0: at most this many drafts a step
    token_limit: int = 1 << 30  # tokens a decode step may take (the step's token budget)
    explore: bool = False  # draft even when no draft seems worth its cost (the estimates are stale)

    def ratios_for(self, reqs: list[Request]) -> list[list[float]]:
        return [list(self.ratios.get(r, self.default_ratio)) for r in reqs]

    def budget(self, reqs: list[Request], caps: list[int], pinned: list[bool]) -> int:
        """Draft slots to verify for these rows: every capped slot when the policy is off or nothing is measured,
        else the count that maximises (rows + expected accepted drafts) / (draft ms + verify ms)."""
        total = sum(caps)
        num_reqs, fixed = len(reqs), sum(c for c, p in zip(caps, pinned) if p)
        limit = max(0, self.token_limit - num_reqs)
        if self.max_verify_tokens > 0:
            limit = min(limit, self.max_verify_tokens)
        if not self.enabled or self.costs is None or total == fixed:
            return min(total, limit)
        free = sorted((s for r, c, p in zip(reqs, caps, pinned) if not p
                       for s in self.survival.get(r, self.default_survival)[:c]), reverse=True)
        gain = [0.0]
        for s in free:
            gain.append(gain[-1] + s)
        fixed_gain = sum(s for r, c, p in zip(reqs, caps, pinned) if p
                         for s in self.survival.get(r, self.default_survival)[:c])
        best, best_rate, best_drafting, best_drafting_rate = 0, -1.0, 0, -1.0
        for tokens in self.costs.token_steps(num_reqs, num_reqs + fixed + len(free)):
            extra = min(max(0, tokens - num_reqs - fixed), len(free))
            if fixed + extra > limit:
                break
            drafts = fixed + extra
            ms = self.costs.verify_ms(num_reqs, num_reqs + drafts) + (self.costs.draft_ms(num_reqs) if drafts else 0.0)
            rate = (num_reqs + fixed_gain + gain[extra]) / max(ms, 1e-6)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = drafts, rate
            if drafts and rate > best_drafting_rate * (1 + 1e-9):
                best_drafting, best_drafting_rate = drafts, rate
        return best_drafting if best == 0 and self.explore else best


@dataclass
class SpecPolicy:
    """The online acceptance estimates behind the views: server-wide and per request."""

    num_drafts: int
    has_confidence: bool
    enabled: bool = True
    costs: StepCosts | None = None
    max_verify_tokens: int = 0
    _global: _Counts = field(init=False)
    _requests: dict = field(default_factory=dict)  # Request -> _Counts
    _last_conf: dict = field(default_factory=dict)  # Request -> [N] c_k of its last draft
    _undrafted: int = 0  # decode steps since one drafted

    def __post_init__(self) -> None:
        # before anything is measured: conditional acceptance NO_HEAD_PRIOR, and the head taken at its word
        self._global = _Counts.prior(self.num_drafts, PRIOR_WEIGHT, NO_HEAD_PRIOR,
                                     NO_HEAD_PRIOR if self.has_confidence else 1.0)

    def observe(self, req: Request, verified: int, accepted: int, conf: list[float] | None) -> None:
        """One step of a request: `verified` drafts checked, `accepted` taken, its draft's c_k (None: none)."""
        if verified <= 0 and conf is None:
            return
        conf = conf if self.has_confidence else None
        counts = self._requests.get(req)
        if counts is None:
            counts = self._requests[req] = _Counts([0.0] * self.num_drafts, [0.0] * self.num_drafts,
                                                   [0.0] * self.num_drafts)
        counts.observe(verified, accepted, conf)
        self._global.observe(verified, accepted, conf)
        if conf is not None:
            self._last_conf[req] = conf

    def stepped(self, drafted: bool) -> None:
        """A decode step ended; it drafted or not."""
        self._undrafted = 0 if drafted else self._undrafted + 1

    def forget(self, req: Request) -> None:
        self._requests.pop(req, None)
        self._last_conf.pop(req, None)

    def _global_ratio(self) -> list[float]:
        g = self._global
        return [a / p if p > 0 else 1.0 for a, p in zip(g.accepted, g.predicted)]

    def _ratio(self, counts: _Counts | None, prior: list[float]) -> list[float]:
        if counts is None:
            return prior
        return [(a + PRIOR_WEIGHT * g) / (p + PRIOR_WEIGHT)
                for a, p, g in zip(counts.accepted, counts.predicted, prior)]

    def view(self, reqs: list[Request], token_limit: int = 1 << 30) -> PolicyView:
        """The estimates of `reqs` as they stand, for sizing their next steps."""
        prior = self._global_ratio()
        g = self._global
        default_cond = [min(a / r, MAX_COND) if r > 0 else NO_HEAD_PRIOR for a, r in zip(g.accepted, g.reached)]
        ratios, survival = {}, {}
        for r in reqs:
            ratio = self._ratio(self._requests.get(r), prior)
            ratios[r] = ratio
            conf = self._last_conf.get(r)
            cond = [min(c * x, MAX_COND) for c, x in zip(conf, ratio)] if conf is not None else \
                ([min(x, MAX_COND) for x in ratio] if not self.has_confidence else default_cond)
            survival[r] = _cumprod(cond)
        return PolicyView(self.enabled, self.num_drafts, self.costs, ratios, survival, tuple(prior),
                          tuple(_cumprod(default_cond)), self.max_verify_tokens, token_limit,
                          explore=self._undrafted >= EXPLORE_EVERY)


def _cumprod(xs: list[float]) -> list[float]:
    out, p = [], 1.0
    for x in xs:
        p *= x
        out.append(p)
    return out
