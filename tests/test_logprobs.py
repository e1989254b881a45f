"""Logprobs: each emitted token's logprob and the top alternatives equal log_softmax of the target's processed
logits (penalties, min_tokens, temperature; before top-k/top-p/min-p), recomputed here by a plain forward."""

import math

import pytest
import torch
from engine_pairs import build_pair
from penalized import next_logits, penalized

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams

PROMPTS = [[3, 4, 5, 3, 4], [9, 9, 1], [1, 2, 3], [50, 60]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=5),
          SamplingParams(temperature=0.8, seed=3, top_k=20, top_p=0.9, max_tokens=10, logprobs=3,
                         presence_penalty=0.7, repetition_penalty=1.3),
          SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, frequency_penalty=0.5, min_tokens=6,
                         stop_token_ids=(0,)),
          SamplingParams(temperature=1.0, seed=4, max_tokens=10)]


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=5, agree=0.005)


def _check(target, prompt: list[int], out, params: SamplingParams) -> None:
    assert len(out.logprobs) == len(out.token_ids)
    t = params.temperature if not params.is_greedy else 1.0
    for j, (tok, logprob, top) in enumerate(out.logprobs):
        seen = out.token_ids[:j]
        assert tok == out.token_ids[j]
        want = (penalized(next_logits(target, prompt + seen), prompt, seen, params, params.stop_token_ids) / t) \
            .log_softmax(-1)
        assert math.isclose(logprob, float(want[tok]), abs_tol=1e-4), (j, logprob, float(want[tok]))
        ref = want.topk(params.logprobs)
        assert [i for i, _ in top] == ref.indices.tolist(), j
        torch.testing.assert_close(torch.tensor([v for _, v in top]), ref.values, rtol=0, atol=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
        if params.is_greedy and top:
            assert top[0][0] == tok


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("ahead", [False, True], ids=["", "step-ahead"])
def test_logprobs_are_the_processed_targets(pair, static, ahead):
    llm = LLM(*pair, device="cpu", block_size=8, num_kv_blocks=256, enforce_eager=not static)
    llm.executor.pipeline.step_ahead = llm.executor.pipeline.draft_ahead = ahead
    outs = llm.generate(PROMPTS, PARAMS)
    for prompt, out, params in zip(PROMPTS, outs, PARAMS):
        if params.logprobs is None:
            assert out.logprobs is None
        else:
            _check(pair[0], prompt, out, params)
    assert all(o.stats["accepted"] > 0 for o in outs)  # the drafts' positions were verified and reported
    alone = llm.generate([PROMPTS[0]], PARAMS[0])[0]  # a greedy batch without penalties: verified in the graph
    _check(pair[0], PROMPTS[0], alone, PARAMS[0])


def _records(llm, prompt: list[int], params: SamplingParams) -> list:
    llm.add_request(prompt, params)
    records = []
    while llm.has_unfinished():
        records += llm.core.step()
    return records


def test_logprobs_end_with_a_stop_inside_an_accepted_run(pair):
    """A stop token id inside an accepted run truncates the tokens and their logprobs alike."""
    llm = LLM(*pair, device="cpu", block_size=8)
    steps = [r.new_token_ids for r in _records(llm, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12))]
    full = [t for s in steps for t in s]
    ends = {sum(map(len, steps[:i + 1])) - 1 for i in range(len(steps))}
    k = next(k for k in range(1, 12) if full[k] not in full[:k] and k not in ends)  # tokens follow it in its step
    records = _records(llm, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, logprobs=2,
                                                       stop_token_ids=(full[k],)))
    assert [t for r in records for t in r.new_token_ids] == full[:k + 1]
    assert all(len(r.logprobs) == len(r.new_token_ids) and [x[0] for x in r.logprobs] == r.new_token_ids
               for r in records)
