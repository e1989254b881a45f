"""Greedy speculative decoding is token-identical to plain greedy decoding of the target, per request."""

import pytest
import torch
from engine_pairs import build_pair

from dspark_serve.engine.core.step_costs import StepCosts
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.reference import greedy_generate
from dspark_serve.engine.sampling_params import SamplingParams

CONFIGS = {  # name: (build_pair kwargs, speculative_config)
    "block4": (dict(), {}),
    "block2-fill-in": (dict(block_size=3, anchor_first=False), {}),
    "block6-n3": (dict(block_size=6), {"num_speculative_tokens": 3}),
    "topk8": (dict(), {"dspark_draft_topk": 8}),
    "reduced-vocab": (dict(draft_vocab=128), {}),
    "confidence-threshold": (dict(), {"dspark_confidence_threshold": 0.3}),
    "survival-threshold": (dict(), {"dspark_survival_threshold": 0.3}),
    "adaptive-binding": (dict(), {}),  # step costs under which the adaptive budget binds (ENGINE below)
    "confidence-token-cap": (dict(), {"dspark_max_verify_tokens": 7}),
    "token-cap-no-confidence": (dict(confidence=False), {"dspark_max_verify_tokens": 7}),
    "agreeing-draft": (dict(agree=0.005, block_size=6), {}),
    "agreeing-confidence": (dict(agree=0.005, block_size=5), {"dspark_confidence_threshold": 0.2}),
}


# each verified token costs as much as a fixed step part: the policy verifies only the likeliest slots
ENGINE = {"adaptive-binding": {"step_costs": StepCosts.linear(0.5, 0.5, 0.1, 0.01)}}


def _prompts(seed: int, count: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 24, (count,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_speculative_equals_plain_greedy(name):
    kw, spec = CONFIGS[name]
    target, draft = build_pair(seed=len(name), **kw)
    llm = LLM(target, draft, spec, device="cpu", block_size=8, num_kv_blocks=512, max_num_seqs=9,
              **ENGINE.get(name, {}))
    prompts = _prompts(len(name), 24)
    params = SamplingParams(temperature=0.0, max_tokens=14)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_generate(target, prompt, 14), (name, prompt)
        assert out.finish_reason == "length" and out.stats["steps"] <= 14
    taus = [o.stats["tau"] for o in outs]
    if name.startswith("agreeing"):
        assert sum(taus) / len(taus) > 2.0, taus
        assert any(0 < a < llm.max_speculative_tokens for o in outs for a in o.stats["accepted_per_step"])
    if "confidence" in name or "survival" in name or "cap" in name or "binding" in name:  # the rule / token cap really cut verification
        assert sum(o.stats["drafted"] for o in outs) < sum(o.stats["steps"] - 1 for o in outs) * llm.max_speculative_tokens
    assert llm.kv.target.num_free == 512 and llm.kv.draft.num_free == 512


def test_alone_equals_batched():
    target, draft = build_pair(seed=5, agree=0.005)
    prompts = _prompts(7, 10)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    batched = LLM(target, draft, device="cpu", block_size=8).generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        alone = LLM(target, draft, device="cpu", block_size=8).generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids


def test_plain_decoding_without_draft_and_per_request_off():
    target, draft = build_pair(seed=3, agree=0.005)
    prompt = _prompts(3, 1)[0]
    ref = greedy_generate(target, prompt, 12)
    plain = LLM(target, None, device="cpu").generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert plain.token_ids == ref and plain.stats["drafted"] == 0 and plain.stats["steps"] == 11
    llm = LLM(target, draft, device="cpu")
    rid = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=12), num_speculative_tokens=0)
    while llm.has_unfinished():
        done = [o for o in llm.step() if o.finished and o.request_id == rid]
    assert done[0].token_ids == ref and done[0].stats["drafted"] == 0
