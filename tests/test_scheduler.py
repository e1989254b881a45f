"""The scheduler without a model: admission within the token budget and max_num_seqs, chunked prefill that never
holds decode rows back, preemption when blocks run out, aborts mid-prefill, requests that finish in their first
step, and the policy's budget in the plan. The executor is stood in for by a function of the plan."""

from __future__ import annotations

from dspark_serve.engine.core.kv_manager import KVCacheManager
from dspark_serve.engine.core.plan import RowResult, SchedulerOutput, StepResult
from dspark_serve.engine.core.policy import SpecPolicy
from dspark_serve.engine.core.scheduler import DraftShape, Scheduler, SchedulerConfig
from dspark_serve.engine.core.step_costs import StepCosts
from dspark_serve.engine.request import Request
from dspark_serve.engine.sampling_params import SamplingParams

DRAFT = DraftShape(num_speculative_tokens=4, query_len=5, num_blocks=256)


def _sched(max_num_seqs=4, tokens=64, blocks=256, draft=DRAFT, policy=None) -> Scheduler:
    kv = KVCacheManager(blocks, 8, draft.num_blocks if draft is not None else None)
    return Scheduler(SchedulerConfig(max_num_seqs, tokens, eos_token_ids=(0,)), kv, draft, policy)


def _req(rid: str, prompt_len: int, max_tokens: int = 8, n: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0, n)


def _run(s: Scheduler, plan: SchedulerOutput, accept: int = 0, token: int = 7):
    """A stand-in executor: every decode row accepts `accept` of its verified drafts and emits `token`s."""
    rows = []
    if plan.decode is not None:
        n = plan.decode.budget
        for cap in plan.decode.caps:
            k = min(cap, n)
            n -= k
            a = min(accept, k)
            rows.append(RowResult([token] * (a + 1), a, k))
    first = {c.req: (token, None) for c in plan.prefill if c.samples}
    return s.update(plan, StepResult(rows, first))


def test_a_wave_is_admitted_together_up_to_max_num_seqs_and_the_budget():
    s = _sched(max_num_seqs=4, tokens=64)
    for i in range(6):
        s.add(_req(f"r{i}", 10))
    plan = s.schedule()
    assert [c.req.request_id for c in plan.prefill] == ["r0", "r1", "r2", "r3"] and plan.decode is None
    assert all(c.samples and c.start == 0 and len(c.tokens) == 10 for c in plan.prefill)
    assert plan.num_tokens == 40 and len(s.waiting) == 2
    _run(s, plan)
    plan = s.schedule()  # the four decode; nobody finished, so the queue waits
    assert len(plan.decode.reqs) == 4 and not plan.prefill and len(s.waiting) == 2


def test_a_long_prompt_is_chunked_beside_running_decode_rows():
    s = _sched(max_num_seqs=4, tokens=32)
    s.add(_req("short", 4, max_tokens=20))
    _run(s, s.schedule())
    s.add(_req("long", 100, max_tokens=4))
    chunks = []
    for _ in range(6):
        plan = s.schedule()
        assert plan.decode is not None and [r.request_id for r in plan.decode.reqs][0] == "short"
        assert plan.num_tokens <= 32
        chunks += [(c.start, len(c.tokens), c.samples) for c in plan.prefill if c.req.request_id == "long"]
        _run(s, plan)
    decode_tokens = 1 + 4  # the short request's row and its drafts, all verified here
    width = 32 - decode_tokens
    assert chunks[:4] == [(0, width, False), (width, width, False), (2 * width, width, False),
                          (3 * width, 100 - 3 * width, True)]
    long = next(r for r in s.running if r.request_id == "long")
    assert long.num_computed == 102 and long.output_ids == [7, 7, 7]  # its first token, then two decode steps


def test_outputs_of_a_step_are_emitted_in_order_and_stop_at_eos_and_length():
    s = _sched()
    s.add(_req("a", 3, max_tokens=1))  # finishes with its first token
    s.add(_req("b", 3, max_tokens=50))
    outs = _run(s, s.schedule())
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [7], "length"), ("b", [7], None)]
    assert s.kv.target.num_free == 256 - len(s.running[0].target_blocks)
    outs = _run(s, s.schedule(), accept=3, token=0)  # EOS inside an accepted run: truncated there
    assert outs[0].new_token_ids == [0] and outs[0].finish_reason == "stop"
    assert s.kv.all_free() and not s.running


def test_where_a_run_of_tokens_stops_a_request():
    """Request.stop_in, which the scheduler commits by and the executor leaves finishing rows out of the step it
    launches ahead by: tokens kept up to and including the first stop, and why."""
    eos = frozenset({0})
    r = Request("r", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=(9,)), 0, 4)
    r.output_ids = [5, 5]
    assert r.stop_in([3, 4], eos) == (2, None)
    assert r.stop_in([3, 0, 4], eos) == (2, "stop")  # EOS
    assert r.stop_in([9, 4], eos) == (1, "stop")  # a stop token id
    assert r.stop_in([3, 4, 6, 7], eos) == (3, "length")  # the fifth token
    ignoring = Request("i", [1], SamplingParams(max_tokens=4, ignore_eos=True), 0, 4)
    assert ignoring.stop_in([0, 0], eos) == (2, None) and ignoring.stop_in([0, 0, 0, 0], eos) == (4, "length")


def test_preemption_frees_the_newest_and_recomputes_it_first():
    s = _sched(max_num_seqs=4, tokens=256, blocks=12)  # 96 slots: two requests fit, their growth does not
    for i in range(2):
        s.add(_req(f"r{i}", 20, max_tokens=60))
    _run(s, s.schedule())
    preempted = None
    for _ in range(20):
        plan = s.schedule()
        if s.num_preemptions:
            preempted = s.waiting[0]
            break
        _run(s, plan, accept=4)
    assert preempted is not None and preempted.request_id == "r1" and preempted.num_computed == 0
    assert preempted.target_blocks == [] and preempted in plan.released
    assert not any(c.req is preempted for c in plan.prefill)  # not taken back in the step that freed it
    while not any(c.req is preempted for c in plan.prefill):
        _run(s, plan, accept=4)
        plan = s.schedule()
    chunk = next(c for c in plan.prefill if c.req is preempted)  # everything but its last token, not sampled
    assert chunk.start == 0 and len(chunk.tokens) == preempted.num_tokens - 1 and not chunk.samples


def test_abort_mid_prefill_frees_its_blocks_and_drops_its_chunks():
    s = _sched(max_num_seqs=2, tokens=16)
    s.add(_req("long", 100))
    plan = s.schedule()
    assert plan.prefill[0].req.request_id == "long" and len(plan.prefill[0].tokens) == 16
    _run(s, plan)
    assert s.abort("long").finish_reason.value == "abort"
    plan = s.schedule()
    assert plan.empty and [r.request_id for r in plan.released] == ["long"] and s.kv.all_free()
    assert s.abort("long") is None


def test_pinned_and_plain_requests_get_their_own_caps():
    s = _sched(tokens=512)
    reqs = [_req("adaptive", 5), _req("pinned", 5, n=2), _req("plain", 5, n=0)]
    reqs[1].spec_pinned = True
    for r in reqs:
        s.add(r)
    _run(s, s.schedule())
    plan = s.schedule()
    assert plan.decode.caps == [4, 2, 0] and plan.decode.pinned == [False, True, False]
    assert plan.decode.budget == 6  # no policy: every capped slot


def test_the_policy_budget_goes_down_as_verifying_gets_dear_and_the_token_budget_bounds_it():
    cheap = SpecPolicy(4, True, costs=StepCosts.linear(1.0, 0.001, 0.1, 0.0))
    dear = SpecPolicy(4, True, costs=StepCosts.linear(1.0, 1.0, 0.1, 0.0))
    budgets = []
    for policy, tokens in ((cheap, 512), (dear, 512), (cheap, 24)):
        s = _sched(max_num_seqs=8, tokens=tokens, policy=policy)
        for i in range(8):
            s.add(_req(f"r{i}", 2))
        _run(s, s.schedule())
        budgets.append(s.schedule().decode.budget)
    assert budgets == [32, 0, 16]  # all 8 x 4 slots; none; the 24-token budget less the 8 rows
