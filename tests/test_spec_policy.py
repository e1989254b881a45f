"""Load-adaptive speculation: the split of a step's budget across rows (a prefix each, by survival rank, pinned
rows first, never looking at the draft it decides on), the budget that maximises expected tokens per millisecond
under measured step costs, the online correction of the confidences, and the step-cost tables and their probe."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_pairs import build_pair

from dspark_serve.engine.core.cost_probe import probe_costs
from dspark_serve.engine.core.policy import SpecPolicy, cap_drafts
from dspark_serve.engine.core.step_costs import StepCosts
from dspark_serve.engine.draft_split import split_budget
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.request import Request
from dspark_serve.engine.sampling_params import SamplingParams


def _split(conf, caps, budget, pinned=None, ratios=None, thresholds=None, floor=0.0):
    conf = torch.tensor(conf)
    r, n = conf.shape
    return split_budget(conf, torch.ones(r, n) if ratios is None else torch.tensor(ratios), torch.tensor(caps),
                        torch.tensor(pinned or [False] * r), torch.tensor(budget),
                        None if thresholds is None else torch.tensor(thresholds), floor).tolist()


def test_the_budget_goes_to_the_likeliest_slots_as_prefixes():
    conf = [[0.9, 0.9, 0.9, 0.9], [0.5, 0.9, 0.9, 0.9], [0.99, 0.2, 0.9, 0.9]]
    # survivals: .9 .81 .729 .656 | .5 .45 .405 .365 | .99 .198 .178 .16
    assert _split(conf, [4, 4, 4], 12) == [4, 4, 4]
    assert _split(conf, [4, 4, 4], 4) == [3, 0, 1]  # .99, .9, .81, .729
    assert _split(conf, [4, 4, 4], 6) == [4, 1, 1]  # then .656 and .5
    assert _split(conf, [2, 4, 0], 6) == [2, 4, 0]  # caps bound each row
    assert _split(conf, [4, 4, 4], 0) == [0, 0, 0]


def test_pinned_rows_and_thresholds():
    conf = [[0.9, 0.9, 0.9], [0.3, 0.3, 0.3]]
    assert _split(conf, [3, 2], 2, pinned=[False, True]) == [0, 2]  # the pinned slots first
    assert _split(conf, [3, 3], 6, thresholds=[0.95, 0.0]) == [0, 3]  # DeepSpec's rule per row
    assert _split(conf, [3, 3], 6, floor=0.5) == [3, 0]  # survival floor on the drafter's own c_k


def test_ties_go_to_the_earlier_position_then_the_lower_row():
    conf = [[1.0, 1.0], [1.0, 1.0]]
    assert _split(conf, [2, 2], 1) == [1, 0] and _split(conf, [2, 2], 3) == [2, 1]


def test_whether_a_slot_is_verified_never_depends_on_its_own_draft():
    """Slot k's survival reads c_0..c_k; c_{k+1} is the first confidence that depends on draft k. So changing
    every confidence after position k (as a different draft k would) never changes whether slot k is verified."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        r, n = 3, 5
        conf = torch.rand(r, n, generator=g)
        caps = torch.randint(0, n + 1, (r,), generator=g)
        budget = int(torch.randint(0, r * n + 1, (1,), generator=g))
        base = split_budget(conf, torch.ones(r, n), caps, torch.zeros(r, dtype=torch.bool), torch.tensor(budget))
        row, k = int(torch.randint(0, r, (1,), generator=g)), int(torch.randint(0, n - 1, (1,), generator=g))
        other = conf.clone()
        other[row, k + 1:] = torch.rand(n - k - 1, generator=g)
        again = split_budget(other, torch.ones(r, n), caps, torch.zeros(r, dtype=torch.bool), torch.tensor(budget))
        assert (base[row] > k) == (again[row] > k)


def test_step_costs_are_monotone_and_read_as_a_staircase_or_a_line():
    costs = StepCosts(((1, ((1, 1.0), (8, 1.2))), (8, ((8, 1.1), (16, 1.0), (64, 2.0)))), ((1, 0.3), (8, 0.5)))
    assert costs.verify_ms(8, 8) == pytest.approx(1.2)  # made monotone: no less than batch 1 at 8 tokens
    assert costs.verify_ms(8, 16) == pytest.approx(1.2)  # and 16 tokens cost what 8 do
    assert costs.verify_ms(4, 10) == pytest.approx(1.2)  # batch 4 takes bucket 8, tokens 10 pad to 16
    assert costs.verify_ms(4, 17) == pytest.approx(2.0)
    assert costs.verify_ms(1, 4) == pytest.approx(1.2) and costs.draft_ms(2) == pytest.approx(0.5)
    assert costs.token_steps(8, 40) == [8, 16, 40]
    line = StepCosts.linear(1.0, 0.5, 0.2, 0.1)
    assert line.verify_ms(3, 10) == pytest.approx(6.0) and line.draft_ms(4) == pytest.approx(0.6)
    assert StepCosts.from_dict(costs.to_dict()) == costs


def _reqs(n):
    return [Request(f"r{i}", [1], SamplingParams(max_tokens=99), 0, 4) for i in range(n)]


def test_the_budget_maximises_tokens_per_millisecond():
    reqs = _reqs(4)
    caps, pinned = [4] * 4, [False] * 4
    view = SpecPolicy(4, True, costs=StepCosts.linear(1.0, 0.0, 0.1, 0.0)).view(reqs)
    assert view.budget(reqs, caps, pinned) == 16  # verifying is free: every slot
    view = SpecPolicy(4, True, costs=StepCosts.linear(1.0, 0.0, 50.0, 0.0)).view(reqs)
    assert view.budget(reqs, caps, pinned) == 0  # the draft costs more than it can bring: plain decoding
    view = SpecPolicy(4, True, costs=StepCosts.linear(4.0, 0.5, 0.0, 0.0)).view(reqs)
    b = view.budget(reqs, caps, pinned)
    # by hand: survivals .6^k (the prior), a slot pays while its survival beats rate * 0.5 ms
    s = sorted((0.6 ** (k + 1) for _ in range(4) for k in range(4)), reverse=True)
    rate = lambda m: (4 + sum(s[:m])) / (4.0 + 0.5 * (4 + m))  # noqa: E731
    assert b == max(range(17), key=rate) and 0 < b < 16
    assert view.budget(reqs, [4, 4, 4, 0], [False, False, False, True]) <= 12
    off = SpecPolicy(4, True, enabled=False, costs=StepCosts.linear(1.0, 0.5, 0.0, 0.0)).view(reqs)
    assert off.budget(reqs, caps, pinned) == 16


def test_the_online_correction_follows_what_is_accepted():
    """A drafter whose head says 0.9 but whose drafts are accepted half the time: its corrected survivals fall
    towards .5^k; without a head the estimate alone does; a forgotten request takes the server-wide prior."""
    reqs = _reqs(2)
    policy = SpecPolicy(3, True)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        accepted = 0
        while accepted < 3 and torch.rand(1, generator=g).item() < 0.5:
            accepted += 1
        policy.observe(reqs[:1], [3], [accepted], [[0.9, 0.9, 0.9]])
    view = policy.view(reqs)
    assert view.ratios[0, 0] == pytest.approx(0.5 / 0.9, abs=0.12)
    assert view.survival[0, 0] == pytest.approx(0.5, abs=0.1)
    assert view.ratios[1, 0] == pytest.approx(0.5 / 0.9, abs=0.12)  # the server-wide estimate as prior
    assert view.survival[1, 0] == pytest.approx(0.5, abs=0.1)  # no draft of its own yet: the measured rate
    policy.forget(reqs[0])
    assert policy.view(reqs).ratios[0, 0] == pytest.approx(view.ratios[1, 0])
    plain = SpecPolicy(3, False)
    for _ in range(200):
        plain.observe(reqs[:1], [3], [3], [None])
    assert plain.view(reqs).survival[0, 2] > 0.9
    assert cap_drafts(7, 4, 3) == 2 and cap_drafts(0, 4, 9) == 0


def test_the_policy_explores_after_steps_without_a_draft():
    reqs = _reqs(2)
    policy = SpecPolicy(4, True, costs=StepCosts.linear(1.0, 0.0, 50.0, 0.0))
    assert policy.view(reqs).budget(reqs, [4, 4], [False, False]) == 0
    for _ in range(16):
        policy.stepped(drafted=False)
    for _ in range(3):  # a run of drafting steps
        assert policy.view(reqs).budget(reqs, [4, 4], [False, False]) > 0
        policy.stepped(drafted=True)
    assert policy.view(reqs).budget(reqs, [4, 4], [False, False]) == 0


def test_the_probe_measures_a_monotone_table_on_cpu():
    target, draft = build_pair(seed=3)
    llm = LLM(target, draft, {}, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=8,
              step_costs=StepCosts.linear(1, 0, 0, 0))
    costs = probe_costs(llm.target, llm.draft, 8, reps=1)
    assert not costs.staircase and [b for b, _ in costs.verify] == [1, 8]
    assert costs.verify_ms(8, 40) >= costs.verify_ms(8, 8) > 0 and costs.draft_ms(8) >= costs.draft_ms(1) > 0
    assert llm.kv.all_free()


@pytest.mark.parametrize("static", [False, True])
def test_greedy_equals_plain_for_any_lengths_changing_every_step(static, monkeypatch):
    """Greedy speculative output equals plain greedy output whatever number of drafts each row verifies, changing
    every step (random budgets, caps and pins), on the dynamic path and on the varlen static path."""
    from dspark_serve.engine.core.scheduler import Scheduler
    from dspark_serve.engine.reference import greedy_generate

    target, draft = build_pair(seed=9, agree=0.01, block_size=6, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    plan_decode = Scheduler._plan_decode

    def shuffled(self, budget):
        plan = plan_decode(self, budget)
        if plan is not None:
            caps = [int(torch.randint(0, c + 1, (1,), generator=g)) for c in plan.caps]
            pinned = [bool(torch.rand(1, generator=g) < 0.3) for _ in caps]
            plan = type(plan)(plan.reqs, caps, pinned, int(torch.randint(0, sum(caps) + 1, (1,), generator=g)),
                              plan.view)
        return plan
    monkeypatch.setattr(Scheduler, "_plan_decode", shuffled)
    llm = LLM(target, draft, {}, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=5,
              enforce_eager=not static)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 11, 7, 20, 5, 9)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy_generate(target, p, 24)
    lens = [k for o in outs for k in o.stats["verified_per_step"]]
    assert len(set(lens)) >= 4 and sum(o.stats["accepted"] for o in outs) > 0
    if static:
        keys = set(llm.target.graphs._runners)
        assert any(t < b * 7 for b, t, _, _ in keys)  # steps shorter than every row at full
        assert any(split for *_, split in keys) and any(not split for *_, split in keys)  # split on device / host


def _device_costs(line: StepCosts, batch: int, tokens: tuple[int, ...]) -> StepCosts:
    """A table as the recorded graphs give it (a staircase of device times), from a smooth model."""
    return StepCosts(((batch, tuple((t, line.verify_ms(batch, t)) for t in tokens)),),
                     ((batch, line.draft_ms(batch)),), staircase=True)


def test_the_host_share_of_a_step_is_learned_and_shifts_the_budget():
    """Steps whose wall time is mostly the host's (a busy Python step loop): the host's share is measured from the
    steps' wall times and added to each step's device time, so verifying more drafts per step (more tokens for the
    same host time) becomes worth it where the device table alone said no."""
    reqs = _reqs(8)
    costs = _device_costs(StepCosts.linear(1.0, 0.05, 0.5, 0.0), 8, (8, 16, 24, 32, 40))
    policy = SpecPolicy(4, True, costs=costs)
    caps, pinned = [4] * 8, [False] * 8
    before = policy.view(reqs).budget(reqs, caps, pinned)
    for _ in range(50):
        policy.timed(8, 8, False, 1.4 + 20.0)  # each step took 20 ms more than its device time
        policy.timed(8, 40, True, 1.0 + 0.05 * 40 + 0.5 + 20.0)
    policy._view = None
    after = policy.view(reqs)
    assert after.host(8, False) == pytest.approx(20.0, rel=0.05) and after.host(8, True) == pytest.approx(20.0, rel=0.05)
    assert after.budget(reqs, caps, pinned) > before


def test_a_plain_step_is_explored_while_drafting_until_its_host_time_is_known():
    reqs = _reqs(4)
    policy = SpecPolicy(4, True, costs=_device_costs(StepCosts.linear(1.0, 0.0, 0.1, 0.0), 4, (4, 8, 12, 16)))
    budgets, last = [], True
    for _ in range(60):
        budgets.append(policy.view(reqs).budget(reqs, [4] * 4, [False] * 4))
        drafted = budgets[-1] > 0
        policy.stepped(drafted)
        if not drafted:
            policy.timed(4, 4, False, 5.0, steady=not last)  # the first plain step is not counted
        last = drafted
    first = budgets.index(0)
    assert first >= 16 and budgets[first:first + 3] == [0, 0, 0] and budgets.count(0) == 3  # one run of 3


def test_drafting_stops_where_plain_steps_emitted_more_tokens_per_millisecond():
    """The estimates say drafting pays (about 10 of 32 drafts accepted for a drafting step's 3 ms against a plain
    step's 2 ms), but the steps as they ran emitted fewer tokens than that: the realized tokens per millisecond of
    each kind decide, drafting is still explored every EXPLORE_EVERY steps, and once drafting emits more per
    millisecond again it resumes. Pinned drafts are verified whatever the rates."""
    reqs = _reqs(8)
    costs = _device_costs(StepCosts.linear(1.0, 0.01, 0.2, 0.0), 8, (8, 16, 24, 32, 40))
    policy = SpecPolicy(4, True, costs=costs)
    caps, pinned = [4] * 8, [False] * 8

    def run(steps: int, emitted_drafting: int) -> list[int]:
        budgets, last = [], None
        for _ in range(steps):
            b = policy.view(reqs).budget(reqs, caps, pinned)
            budgets.append(b)
            policy.stepped(b > 0)
            policy.timed(8, 8 + b, b > 0, 3.0 if b else 2.0, steady=last == (b > 0),
                         emitted=emitted_drafting if b else 8)
            last = b > 0
        return budgets

    assert run(40, 8 + 20)[-1] > 0  # 9.3 tokens/ms drafting against 4 plain
    slow = run(200, 8 + 2)[100:]  # 3.3 tokens/ms drafting: plain wins
    assert slow.count(0) > 0.75 * len(slow)  # mostly plain
    assert 0 < sum(b > 0 for b in slow) <= len(slow) // 5  # drafting explored now and then, briefly
    assert max(len(list(g)) for k, g in itertools.groupby(slow, key=bool) if k) <= 3
    assert policy.view(reqs).budget(reqs, caps, [True] + [False] * 7) == 4  # pinned drafts only
    assert run(200, 8 + 20)[-20:].count(0) <= 2  # drafting pays again: it resumes


def test_explorations_back_off_while_plain_steps_stay_faster():
    """A drafter the target rejects: each exploration confirms plain steps are faster, so the plain runs between
    explorations double from EXPLORE_EVERY up to MAX_EXPLORE_EVERY; when drafting pays again they are short again."""
    from dspark_serve.engine.core.policy import EXPLORE_EVERY, MAX_EXPLORE_EVERY

    reqs = _reqs(8)
    costs = _device_costs(StepCosts.linear(1.0, 0.01, 0.2, 0.0), 8, (8, 16, 24, 32, 40))
    policy = SpecPolicy(4, True, costs=costs)
    caps, pinned = [4] * 8, [False] * 8
    budgets, last = [], None
    for _ in range(400):
        b = policy.view(reqs).budget(reqs, caps, pinned)
        budgets.append(b)
        policy.stepped(b > 0)
        policy.timed(8, 8 + b, b > 0, 3.0 if b else 2.0, steady=last == (b > 0), emitted=8 + 1 if b else 8)
        last = b > 0
    plain_runs = [len(list(g)) for k, g in itertools.groupby(budgets, key=bool) if not k][1:-1]
    assert plain_runs[0] <= 2 * EXPLORE_EVERY and plain_runs[-1] == MAX_EXPLORE_EVERY, plain_runs
    assert plain_runs == sorted(plain_runs)
    assert sum(b > 0 for b in budgets[200:]) <= 3 * (200 // MAX_EXPLORE_EVERY + 1)


def test_the_server_wide_estimate_outlives_a_wave_s_slowest_requests():
    """A full batch accepting most drafts, then the wave's last steps with two requests accepting none: a new
    request's expected survival stays near the batch's, not the stragglers'."""
    batch, tail = _reqs(128), _reqs(2)
    policy = SpecPolicy(4, True)
    for _ in range(20):
        policy.observe(batch, [4] * 128, [3] * 128, [[0.8] * 4] * 128)
    for _ in range(10):
        policy.observe(tail, [4, 4], [0, 0], [[0.8] * 4] * 2)
    fresh = _reqs(1)
    view = policy.view(fresh)
    assert view.survival[0, 0] > 0.85 and view.survival[0, 2] > 0.6


def test_drafting_steps_with_pinned_rows_do_not_count_as_the_policy_s_rate():
    """A step whose rows pinned their drafts tells the host's share of a step, not how many tokens per millisecond
    the policy's own budgets yield: its emitted tokens are not reported (so a run of k = 1 requests cannot make
    plain decoding look faster than drafting); the policy's own drafting steps are."""
    target, draft = build_pair(seed=3, agree=0.01)
    llm = LLM(target, draft, {}, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=4)
    told = []
    policy = llm.scheduler.policy
    policy.timed = lambda *a, **kw: told.append((a, kw))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for pin in (1, None):
        told.clear()
        for i in range(3):
            llm.add_request([3, 1, 4, i], params, num_speculative_tokens=pin)
        while llm.has_unfinished():
            llm.step()
        drafted = [a[5] if len(a) > 5 else kw.get("emitted") for a, kw in told if a[2]]
        assert drafted, told
        if pin is None:
            assert all(isinstance(e, int) and e >= 1 for e in drafted)
        else:
            assert all(e is None for e in drafted)


def test_the_policy_host_time_benchmark_runs():
    """bench/bench_policy.py: waves of requests through the policy alone, on the shipped H100 cost table."""
    from bench_scripts import load_bench

    rows = load_bench("bench_policy").main(["--levels", "4", "16", "--waves", "2"])["levels"]
    assert [r["concurrency"] for r in rows] == [4, 16]
    # 128 tokens a request at 1-8 tokens a step: a wave lasts between 16 and 128 steps
    assert all(r["us_per_step_median"] > 0 and 16 <= r["steps_per_wave"] <= 128 for r in rows)
