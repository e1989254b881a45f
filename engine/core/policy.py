"""Load-adaptive speculation: how many of its drafts each request verifies this step.

Survival of draft slot k is the chance that drafts 0..k are all accepted: the running product of the drafter's
conditional confidences c_0..c_k, each corrected by the acceptance measured online at its position (per request,
shrunk towards the server-wide estimate; without a confidence head the online estimate alone). The scheduler
sizes the step's budget B of verified drafts from what is known before the step's drafts exist (the survivals of
each request's previous drafts) and what a step costs, maximising expected tokens per millisecond: the device's
time from the tables measured at start (StepCosts) plus the host's share of a step, measured online per batch size
(the step's wall time less its device time); the executor then gives B to the slots with the highest survivals
across the batch (engine/draft_split.py, on the device). The estimates are refreshed every REFRESH_STEPS steps or
when the batch changes, so a step costs the policy a few lookups.

Lossless: whether slot k is verified depends on c_0..c_k (which depend on the drafts before k, never on draft k),
on slots of other requests, and on the past; never on draft k itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..draft_split import MAX_COND
from .step_costs import StepCosts

if TYPE_CHECKING:
    from ..request import Request

PRIOR_WEIGHT = 4.0  # pseudo-observations of the server-wide correction behind each request's own
DECAY = 0.97  # weight of older observations per step that adds some, so the estimates follow a changing text
NO_HEAD_PRIOR = 0.6  # conditional acceptance assumed per position before anything is measured (no confidence head)
EXPLORE_EVERY = 16  # steps without a draft after which one drafts anyway, so the estimates keep up with the text
MAX_EXPLORE_EVERY = 64  # the gap doubles up to this while each exploration finds plain steps still faster there
PLAIN_EVERY = 256  # drafting steps after which one step is plain, so the host's share of a plain step stays known
EXPLORE_RUN = 3  # steps an exploration lasts: the first step after a switch carries the last one's queued work,
# so only the steps after it are timed
REFRESH_STEPS = 4  # steps a view serves an unchanged batch before the estimates are folded in again
HOST_EMA = 0.1  # weight of a new step's measured host time (and of its tokens per millisecond)


def cap_drafts(pinned_or_default: int, max_drafts: int, remaining: int) -> int:
    """Drafts a request can use in a step: its own cap, the draft's block, and its remaining tokens minus the
    correction/bonus token."""
    return max(0, min(pinned_or_default, max_drafts, remaining - 1))


@dataclass(frozen=True)
class PolicyView:
    """What the budget of a step is sized from, fixed when it is planned; the executor sizes a step it launches
    ahead from the same view. Rows of `ratios` and `survival` are the requests of `index`."""

    enabled: bool
    num_drafts: int  # N, the draft's block
    costs: StepCosts | None
    index: dict  # Request -> its row
    ratios: np.ndarray  # [R, N] online correction of each request's c_k
    survival: np.ndarray  # [R, N] expected survival of each request's next slots
    default_ratio: np.ndarray  # [N] for a request the view does not hold
    default_survival: np.ndarray  # [N]
    max_verify_tokens: int = 0  # > 0: at most this many drafts a step
    token_limit: int = 1 << 30  # tokens a decode step may take (the step's token budget)
    explore: bool = False  # draft even when no draft seems worth its cost (the estimates are stale)
    explore_plain: bool = False  # a plain step, whatever the drafts seem worth (its host time is unknown or stale)
    host_ms: dict | None = None  # (batch bucket, drafted) -> the host's measured ms a step beyond the device's
    plain_faster: frozenset = frozenset()  # batch buckets where plain steps emitted more tokens/ms than drafting
    _budgets: dict | None = None  # budgets already computed from this view

    def _rows(self, table: np.ndarray, default: np.ndarray, reqs: list[Request]) -> np.ndarray:
        rows = [self.index.get(r, -1) for r in reqs]
        if rows and min(rows) >= 0:
            return table[rows]
        return np.stack([table[i] if i >= 0 else default for i in rows]) if rows else table[:0]

    def ratios_for(self, reqs: list[Request]) -> list[list[float]]:
        return self._rows(self.ratios, self.default_ratio, reqs).tolist()

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
        key = (tuple(map(id, reqs)), tuple(caps), tuple(pinned), limit)
        if self._budgets is not None and key in self._budgets:
            return self._budgets[key]
        best = self._best_budget(reqs, caps, pinned, fixed, limit)
        if self._budgets is not None:
            self._budgets[key] = best
        return best

    def host(self, num_reqs: int, drafted: bool) -> float:
        """The host's ms a step of num_reqs rows beyond its device time (measured; 0 before any measurement)."""
        if not self.host_ms:
            return 0.0
        b = next((k for k in sorted({k for k, _ in self.host_ms}) if k >= num_reqs), None)
        got = [self.host_ms.get((b, d)) for d in (drafted, not drafted)] if b is not None else []
        return next((x for x in got if x is not None), 0.0)

    def _best_budget(self, reqs: list[Request], caps: list[int], pinned: list[bool], fixed: int, limit: int) -> int:
        num_reqs = len(reqs)
        surv = self._rows(self.survival, self.default_survival, reqs)  # [R, N]
        in_cap = np.arange(self.num_drafts)[None, :] < np.asarray(caps)[:, None]
        is_pinned = np.asarray(pinned, dtype=bool)[:, None]
        free = np.sort(surv[in_cap & ~is_pinned])[::-1]
        gain = np.concatenate([[0.0], np.cumsum(free)])
        fixed_gain = float(surv[in_cap & is_pinned].sum())
        best, best_rate, best_drafting, best_drafting_rate = 0, -1.0, 0, -1.0
        for tokens in self.costs.token_steps(num_reqs, num_reqs + fixed + len(free)):
            extra = min(max(0, tokens - num_reqs - fixed), len(free))
            if fixed + extra > limit:
                break
            drafts = fixed + extra
            ms = self.costs.verify_ms(num_reqs, num_reqs + drafts) + \
                (self.costs.draft_ms(num_reqs) + self.host(num_reqs, True) if drafts else self.host(num_reqs, False))
            rate = (num_reqs + fixed_gain + float(gain[extra])) / max(ms, 1e-6)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = drafts, rate
            if drafts and rate > best_drafting_rate * (1 + 1e-9):
                best_drafting, best_drafting_rate = drafts, rate
        if self.explore_plain and fixed == 0:
            return 0
        if self.explore:
            return best_drafting if best == 0 else best
        return fixed if best > fixed and self.costs.bucket(num_reqs) in self.plain_faster else best


def fixed_view(num_drafts: int, token_limit: int, max_verify_tokens: int = 0) -> PolicyView:
    """The view of no policy: every capped slot, within the token limit (and max_verify_tokens)."""
    empty = np.zeros((0, num_drafts))
    ones = np.ones(num_drafts)
    return PolicyView(False, num_drafts, None, {}, empty, empty, ones, ones, max_verify_tokens, token_limit)


class SpecPolicy:
    """The online acceptance estimates behind the views, server-wide and per request (a row of arrays each): per
    draft position, decayed counts of slots reached (every earlier draft accepted, this one verified), of those
    accepted, and the sum of their predicted c_k (1 without a confidence head). Observations are buffered and
    folded in when a view is refreshed."""

    def __init__(self, num_drafts: int, has_confidence: bool, enabled: bool = True, costs: StepCosts | None = None,
                 max_verify_tokens: int = 0) -> None:
        self.num_drafts, self.has_confidence, self.enabled = num_drafts, has_confidence, enabled
        self.costs, self.max_verify_tokens = costs, max_verify_tokens
        n = num_drafts
        # before anything is measured: conditional acceptance NO_HEAD_PRIOR, and the head taken at its word
        self._global = np.array([[PRIOR_WEIGHT] * n, [PRIOR_WEIGHT * NO_HEAD_PRIOR] * n,
                                 [PRIOR_WEIGHT * (NO_HEAD_PRIOR if has_confidence else 1.0)] * n])  # [3, N]
        self._rows: dict = {}  # Request -> its row in the arrays
        self._free: list[int] = list(range(15, -1, -1))
        self._counts = np.zeros((16, 3, n))  # [rows, (reached, accepted, predicted), N]
        self._conf = np.zeros((16, n))  # [rows, N] c_k of each request's last draft
        self._has_conf = np.zeros(16, dtype=bool)
        self._pending: list[tuple] = []  # observations not folded in yet
        self._undrafted = 0  # decode steps since one drafted
        self._drafted = 0  # decode steps since one was plain
        self._exploring = False  # a run of steps against the estimates is on
        self._explore_every = EXPLORE_EVERY  # plain steps before the next drafting exploration
        self._bucket: int | None = None  # the batch bucket of the last view
        self._view: PolicyView | None = None
        self._view_key: tuple = ()
        self._age = 0
        self._host: dict = {}  # (batch bucket, drafted) -> ms
        self._rate: dict = {}  # (batch bucket, drafted) -> tokens emitted per ms of wall time

    @property
    def measures_host(self) -> bool:
        """Whether the host's share of a step is measured online: when the costs are the device's alone (read off
        the recorded CUDA graphs, a staircase); costs timed on the host's clock include it already."""
        return self.costs is not None and self.costs.staircase

    def _row(self, req: Request) -> int:
        row = self._rows.get(req)
        if row is None:
            if not self._free:
                grow = len(self._counts)
                self._free = list(range(len(self._counts), len(self._counts) + grow))
                self._counts = np.concatenate([self._counts, np.zeros((grow, 3, self.num_drafts))])
                self._conf = np.concatenate([self._conf, np.zeros((grow, self.num_drafts))])
                self._has_conf = np.concatenate([self._has_conf, np.zeros(grow, dtype=bool)])
            row = self._rows[req] = self._free.pop()
            self._counts[row] = 0.0
            self._has_conf[row] = False
        return row

    def observe(self, reqs: list[Request], verified: list[int], accepted: list[int],
                conf: list[list[float] | None]) -> None:
        """One step of these requests: drafts verified and accepted, and each draft's c_k (None: no draft ran, or
        no confidence head)."""
        self._pending.append((reqs, verified, accepted, conf))

    def timed(self, num_reqs: int, num_tokens: int, drafted: bool, wall_ms: float, steady: bool = True,
              emitted: int | None = None) -> None:
        """A decode step's wall time (from its start to the next step's): what the host added to its device time
        becomes the estimate for its batch bucket, and the tokens it emitted (`emitted`; a plain step's default is one
        a row) per millisecond the realized rate of its kind there. Not `steady` (the step before it drafted or not
        as it did not): it carries the other kind's queued work, and is not counted."""
        if not self.measures_host or not steady:
            return
        device = self.costs.verify_ms(num_reqs, num_tokens) + (self.costs.draft_ms(num_reqs) if drafted else 0.0)
        b = self.costs.bucket(num_reqs)
        old = self._host.get((b, drafted))
        sample = max(0.0, wall_ms - device)
        if old is not None:
            sample = min(sample, 3 * old + 1.0)  # an idle gap or a stall is not a step's cost
        self._host[b, drafted] = sample if old is None else (1 - HOST_EMA) * old + HOST_EMA * sample
        if emitted is None and drafted:
            return
        rate = (num_reqs if emitted is None else emitted) / max(device + sample, 1e-6)
        old = self._rate.get((b, drafted))
        self._rate[b, drafted] = rate if old is None else (1 - HOST_EMA) * old + HOST_EMA * rate

    def _fold(self) -> None:
        pending, self._pending = self._pending, []
        for step in pending:
            self._fold_step(*step)

    def _fold_step(self, reqs: list[Request], verified: list[int], accepted: list[int],
                   conf: list[list[float] | None]) -> None:
        keep = [i for i, (v, c) in enumerate(zip(verified, conf)) if (v > 0 or c is not None) and reqs[i].finish_reason
                is None]
        if not keep:
            return
        n = self.num_drafts
        rows = [self._row(reqs[i]) for i in keep]
        v, a = np.asarray(verified)[keep], np.asarray(accepted)[keep]
        k = np.arange(n)[None, :]
        reached = k < np.minimum(a + 1, v)[:, None]  # [R', N]
        hit = (k < a[:, None]) & reached
        with_conf = [j for j, i in enumerate(keep) if conf[i] is not None] if self.has_confidence else []
        pred = np.ones((len(keep), n))
        if with_conf:
            c = np.asarray([conf[keep[j]] for j in with_conf])
            pred[with_conf] = c
            self._conf[[rows[j] for j in with_conf]] = c
            self._has_conf[[rows[j] for j in with_conf]] = True
        obs = np.stack([reached, hit, reached * pred], 1).astype(float)  # [R', 3, N]
        counts = self._counts[rows]
        self._counts[rows] = np.where(reached[:, None, :], counts * DECAY + obs, counts)
        # the server-wide estimate ages by steps, not rows: at 128 rows a step a per-row decay would keep little
        # more than the last step, and the last steps of a wave are its slowest requests'
        self._global = self._global * np.where(reached.any(0), DECAY, 1.0) + obs.sum(0)

    def stepped(self, drafted: bool) -> None:
        """A decode step ended; it drafted or not."""
        self._undrafted = 0 if drafted else self._undrafted + 1
        self._drafted = self._drafted + 1 if drafted else 0
        if self._exploring and max(self._drafted, self._undrafted) >= EXPLORE_RUN:
            self._exploring = False
            if self._drafted >= EXPLORE_RUN:  # a drafting run ended: wait longer while plain stays faster here
                slower = self._bucket in self._plain_faster()
                self._explore_every = min(2 * self._explore_every, MAX_EXPLORE_EVERY) if slower else EXPLORE_EVERY
        elif drafted and not self._exploring:
            self._explore_every = EXPLORE_EVERY
        self._age += 1

    def _explore_drafting(self) -> bool:
        """Draft whatever the drafts seem worth: EXPLORE_EVERY plain steps passed (until EXPLORE_RUN drafted); twice
        as many after each exploration that found plain steps faster, up to MAX_EXPLORE_EVERY."""
        due = self._undrafted >= self._explore_every or (self._exploring and 0 < self._drafted < EXPLORE_RUN)
        self._exploring |= due
        return due

    def _plain_due(self, num_reqs: int) -> bool:
        """Plain steps are due (EXPLORE_RUN of them): the host's share of one is unknown for this batch size (after
        EXPLORE_EVERY drafting steps), or PLAIN_EVERY drafting steps passed."""
        if not self.measures_host:
            return False
        b = self.costs.bucket(num_reqs)
        due = self._drafted >= (EXPLORE_EVERY if (b, False) not in self._host else PLAIN_EVERY) \
            or (self._exploring and 0 < self._undrafted < EXPLORE_RUN)
        self._exploring |= due
        return due

    def forget(self, req: Request) -> None:
        row = self._rows.pop(req, None)
        if row is not None:
            self._free.append(row)
            self._view = None

    def view(self, reqs: list[Request], token_limit: int = 1 << 30) -> PolicyView:
        """The estimates of `reqs`, for sizing their next steps: the last view while the batch is unchanged and
        fresh (REFRESH_STEPS), else refreshed."""
        if not self.enabled:
            return fixed_view(self.num_drafts, token_limit, self.max_verify_tokens)
        if self.costs is not None:
            self._bucket = self.costs.bucket(len(reqs))
        key = (tuple(map(id, reqs)), token_limit, self._explore_drafting(), self._plain_due(len(reqs)))
        if self._view is not None and key == self._view_key and self._age < REFRESH_STEPS:
            return self._view
        self._fold()
        self._view, self._view_key, self._age = self._build(reqs, token_limit, key), key, 0
        return self._view

    def _build(self, reqs: list[Request], token_limit: int, key: tuple) -> PolicyView:
        reached, acc, pred = self._global
        prior = np.where(pred > 0, acc / np.maximum(pred, 1e-12), 1.0)  # [N] server-wide correction
        default_cond = np.minimum(np.where(reached > 0, acc / np.maximum(reached, 1e-12), NO_HEAD_PRIOR), MAX_COND)
        rows = [self._rows.get(r, -1) for r in reqs]
        at = [max(i, 0) for i in rows]
        known = np.asarray([i >= 0 for i in rows], dtype=bool)
        counts = self._counts[at]
        ratio = (counts[:, 1] + PRIOR_WEIGHT * prior) / (counts[:, 2] + PRIOR_WEIGHT)  # [R, N]
        ratio = np.where(known[:, None], ratio, prior)
        if self.has_confidence:
            has = known & self._has_conf[at]
            cond = np.where(has[:, None], np.minimum(self._conf[at] * ratio, MAX_COND), default_cond)
        else:
            cond = np.minimum(ratio, MAX_COND)
        return PolicyView(True, self.num_drafts, self.costs, {r: i for i, r in enumerate(reqs)}, ratio,
                          np.cumprod(cond, -1), prior, np.cumprod(default_cond), self.max_verify_tokens,
                          token_limit, explore=key[2], explore_plain=key[3], host_ms=dict(self._host),
                          plain_faster=self._plain_faster(), _budgets={})

    def _plain_faster(self) -> frozenset:
        """Buckets where plain steps emitted more tokens per millisecond than drafting steps: whatever the estimates
        say, drafting there loses to plain decoding, so only pinned drafts are verified (drafting is still explored
        every EXPLORE_EVERY steps, which keeps its rate current)."""
        return frozenset(b for (b, d), r in self._rate.items()
                         if not d and (b, True) in self._rate and r > self._rate[b, True])
