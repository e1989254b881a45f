"""Stops (EOS, stop ids, stop strings, max_tokens) truncate accepted runs; abort frees blocks; streaming is ordered."""

import asyncio

import pytest
from byte_tokenizer import byte_tokenizer
from engine_pairs import build_pair

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.reference import greedy_generate
from dspark_serve.engine.request import StepOutput
from dspark_serve.engine.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=4, agree=0.002, block_size=6)


@pytest.fixture(scope="module")
def reference(pair):
    return greedy_generate(pair[0], PROMPT, 40)


def _llm(pair, **kw):
    return LLM(pair[0], pair[1], device="cpu", block_size=8, num_kv_blocks=256, **kw)


def test_long_accepted_runs_happen(pair):
    out = _llm(pair).generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0]
    assert max(out.stats["accepted_per_step"]) >= 4


@pytest.mark.parametrize("index", [3, 9, 17])
def test_stop_token_inside_accepted_run_truncates(pair, reference, index):
    stop = reference[index]
    first = reference.index(stop)
    out = _llm(pair).generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(stop,)))[0]
    assert out.token_ids == reference[:first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(pair, reference):
    eos = reference[6]
    first = reference.index(eos)
    llm = _llm(pair, eos_token_ids=[eos])
    assert llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0].token_ids == reference[:first + 1]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert out.token_ids == reference and out.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text_and_tokens(pair, reference, include):
    tok = byte_tokenizer(256)  # id == byte: the reference's bytes are the text
    llm = _llm(pair, tokenizer=tok)
    full = tok.decode(reference)
    stop = tok.decode(reference[12:14])
    assert stop and stop in full
    at = full.index(stop)
    params = SamplingParams(temperature=0, max_tokens=40, stop=(stop,), include_stop_str_in_output=include)
    out = llm.generate([PROMPT], params)[0]
    assert out.finish_reason == "stop" and out.text == full[:at + (len(stop) if include else 0)]
    assert out.token_ids == reference[:len(out.token_ids)] and len(out.token_ids) <= 14
    assert tok.decode(out.token_ids).startswith(out.text) and stop in tok.decode(out.token_ids)
    assert llm.kv.target.num_free == llm.kv.target.num_blocks


def test_abort_frees_blocks_and_others_continue(pair, reference):
    llm = _llm(pair)
    free = llm.kv.target.num_free
    a = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    b = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    llm.step()
    llm.step()
    assert llm.kv.target.num_free < free
    assert llm.abort(a) and not llm.abort("nope")
    finished = {}
    while llm.has_unfinished():
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    assert finished[a].finish_reason == "abort" and finished[b].token_ids == reference
    assert llm.kv.target.num_free == free and llm.kv.draft.num_free == free


def test_async_stream_is_ordered_and_complete(pair, reference):
    llm = _llm(pair)

    async def consume(params):
        return [o async for o in llm.generate_stream(PROMPT, params)]

    async def both():
        return await asyncio.gather(consume(SamplingParams(temperature=0, max_tokens=40)),
                                    consume(SamplingParams(temperature=0, max_tokens=10)))

    long, short = asyncio.run(both())
    for outs, n in ((long, 40), (short, 10)):
        streamed = [t for o in outs for t in o.new_token_ids]
        assert streamed == reference[:n] and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert len(outs) == outs[-1].stats["steps"] + 1  # one message per verify step, plus the prefill token


@pytest.mark.parametrize("prompt,params,kw,message", [
    ([], SamplingParams(), {}, "prompt is empty"),
    ([1, 300], SamplingParams(), {}, "prompt token ids must be in [0, 256)"),
    ([1], SamplingParams(temperature=float("nan")), {}, "temperature must be a finite number"),
    ([1], SamplingParams(top_p=0.0), {}, "top_p must be in (0, 1]"),
    ([1], SamplingParams(max_tokens=5000), {}, "max_tokens must be <="),
    ([1] * 4000, SamplingParams(max_tokens=200), {}, "exceeds max_model_len"),
    ([1], SamplingParams(), {"num_speculative_tokens": 7}, "num_speculative_tokens must be in [0, 6]"),
])
def test_bad_requests_are_rejected_with_the_field_named(pair, prompt, params, kw, message):
    llm = _llm(pair)
    with pytest.raises(ValueError) as e:
        llm.add_request(prompt, params, **kw)
    assert message in str(e.value)
    assert not llm.has_unfinished()


def test_preemption_under_a_small_cache_keeps_outputs_exact(pair):
    """24 blocks of 8 tokens cannot hold six 40-token requests at once: some are preempted and recomputed."""
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
    refs = [greedy_generate(pair[0], p, 40) for p in prompts]
    llm = LLM(pair[0], pair[1], device="cpu", block_size=8, num_kv_blocks=24)
    for p in prompts:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=40))
    finals = {}
    while llm.has_unfinished():
        finals.update({o.request_id: o for o in llm.step() if o.finished})
    assert llm.scheduler.num_preemptions > 0
    assert [finals[f"req-{i}"].token_ids for i in range(6)] == refs
    assert llm.kv.target.num_free == 24 and llm.kv.draft.num_free == 24


def test_step_outputs_carry_only_new_tokens(pair, reference):
    """The record a step emits per request: its new tokens; finish reason and stats only on the last one."""
    llm = _llm(pair)
    llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    records = []
    while llm.has_unfinished():
        records += llm.core.step()
    assert all(type(r) is StepOutput and r.logprobs is None for r in records)
    assert [t for r in records for t in r.new_token_ids] == reference
    assert all(1 <= len(r.new_token_ids) <= llm.max_speculative_tokens + 1 for r in records)
    assert all(r.finish_reason is None and r.stats is None for r in records[:-1])
    assert records[-1].finish_reason == "length" and records[-1].stats["steps"] == len(records) - 1


def test_requests_ending_at_their_first_token_leave_no_blocks_behind(pair):
    """max_tokens = 1 (or a first-token stop) while others decode: the scheduler must not grow blocks for a
    request it has just finished."""
    llm = _llm(pair)
    total = llm.kv.target.num_blocks
    long = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    llm.step()
    for i in range(10):
        llm.add_request([9] * (30 + i), SamplingParams(temperature=0, max_tokens=1))
        llm.step()
    first = llm.generate([[11, 12]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids[0]
    llm.add_request([11, 12], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(first,)))
    while llm.has_unfinished():
        llm.step()
    assert long not in llm.core.live_ids()
    assert llm.kv.target.num_free == total and llm.kv.draft.num_free == total


def test_unseeded_requests_draw_fresh_randomness(pair):
    """Two fresh engines (and two requests of one engine) sample differently unless a seed is given."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    a, b = _llm(pair), _llm(pair)
    first = a.generate([PROMPT], params)[0].token_ids
    assert first != b.generate([PROMPT], params)[0].token_ids
    assert first != a.generate([PROMPT], params)[0].token_ids
    seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)
    assert a.generate([PROMPT], seeded)[0].token_ids == b.generate([PROMPT], seeded)[0].token_ids


def test_the_context_limit_is_the_models(pair):
    """max_model_len defaults to the target's max_position_embeddings, or to one sequence's share of the KV cache
    when that is less; more is refused, naming the limits."""
    big = LLM(pair[0], pair[1], device="cpu", block_size=8, num_kv_blocks=1024)
    assert big.max_model_len == pair[0].config.max_position == 4096
    llm = _llm(pair)
    # the cache slots kept past a sequence: this step's verify, the one launched ahead and the draft block behind it
    share = 256 * 8 - 2 * (1 + llm.draft.num_speculative_tokens) - llm.draft.query_len
    assert llm.max_model_len == share < 4096
    assert _llm(pair, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match=f"max_model_len must be in \\[2, {share}\\].*4096.*{share} tokens"):
        _llm(pair, max_model_len=share + 1)
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(100\)"):
        _llm(pair, max_model_len=100).add_request([1] * 90, SamplingParams(max_tokens=11))


def test_adds_and_aborts_during_a_step_wait_for_the_next(pair, reference):
    """An add and an abort arriving while a step runs neither wait for it nor change it; the next step applies
    them in order, so a request aborted while still being admitted never runs."""
    import threading

    llm = _llm(pair)
    llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    llm.step()
    entered, release, outs = threading.Event(), threading.Event(), []
    verify = llm.target.verify

    def held_verify(*args, **kwargs):
        entered.set()
        release.wait(10)
        return verify(*args, **kwargs)

    llm.target.verify = held_verify
    stepper = threading.Thread(target=lambda: outs.extend(llm.step()))
    stepper.start()
    assert entered.wait(10)
    b = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    c = llm.add_request([9, 9, 9], SamplingParams(temperature=0, max_tokens=40))
    assert llm.abort(c) and stepper.is_alive()  # neither waited for the step
    release.set()
    stepper.join(10)
    assert {o.request_id for o in outs} == {"req-0"}
    llm.target.verify = verify
    final = {}
    while llm.has_unfinished():
        for o in llm.step():
            assert o.request_id != c or (o.finished and not o.token_ids)
            if o.finished:
                final[o.request_id] = o
    assert final[c].finish_reason == "abort" and final[b].token_ids == reference
