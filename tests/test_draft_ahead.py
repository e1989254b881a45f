"""Drafting ahead (the next step's draft launched right after this step's accept) changes no output: greedy and
seeded sampling, continuous batching with admissions, stop tokens and length limits; and it is really used."""

import pytest
from engine_pairs import build_pair, random_prompts

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.core.pipeline import StepPipeline


@pytest.mark.parametrize("spec", [{}, {"dspark_draft_topk": 8}])
@pytest.mark.parametrize("static", [False, True])
def test_draft_ahead_changes_no_output(spec, static, monkeypatch):
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    prompts = random_prompts(3, 14)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=12 + 3 * i, seed=i,
                             stop_token_ids=(7,) if i % 3 == 0 else ()) for i in range(len(prompts))]
    outs = {}
    used = []
    taken = StepPipeline.take_drafted
    monkeypatch.setattr(StepPipeline, "take_drafted", lambda p, r, *a: used.append(taken(p, r, *a)) or used[-1])
    spec = {"enable_adaptive_verification": False, **spec}  # every capped draft verified (see test_step_ahead.py)
    for ahead in (False, True):
        llm = LLM(target, draft, spec, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=4,
                  enforce_eager=not static)
        llm.executor.pipeline.draft_ahead = ahead
        used.clear()
        outs[ahead] = llm.generate(prompts, params)  # 14 prompts through 4 slots: admissions between steps
        assert llm.kv.target.num_free == 256 and llm.kv.draft.num_free == 256
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.stats["accepted_per_step"] == b.stats["accepted_per_step"]
    hits = sum(p is not None for p in used)
    assert hits > len(used) // 2, (hits, len(used))  # most steps took the draft launched ahead
    assert hits < len(used)  # and some batches changed (admissions, stops), so it was discarded there
