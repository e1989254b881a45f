"""Penalties and min_tokens: the pure functions against plain loops, and greedy speculative decoding with them
equal to plain greedy decoding of the penalized target, token for token."""

import pytest
import torch
from engine_pairs import build_pair
from penalized import penalized, penalized_greedy

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.penalties import apply_penalties, counts_before, mask_before_min, token_counts
from dspark_serve.engine.sampling_params import SamplingParams


def test_penalty_functions_match_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    num_reqs, width, vocab = 3, 4, 11
    logits = torch.randn(num_reqs, width, vocab, generator=g) * 3
    prompts = [[1, 2, 2, 9], [0], [5, 6]]
    outputs = [[2, 3, 3], [], [10, 5, 5, 5]]
    drafts = torch.tensor([[3, 7, 3], [4, 4, -1], [-1, -1, -1]])
    params = [SamplingParams(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.3, max_tokens=8),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5, max_tokens=8),
              SamplingParams(repetition_penalty=1.0, presence_penalty=2.0, frequency_penalty=-2.0, max_tokens=8)]
    mask = torch.zeros(num_reqs, vocab, dtype=torch.bool)
    for i, p in enumerate(prompts):
        mask[i, p] = True
    pad = max(map(len, outputs))
    counts = token_counts(torch.tensor([o + [-1] * (pad - len(o)) for o in outputs]), vocab)
    f = lambda name: torch.tensor([getattr(p, name) for p in params])  # noqa: E731
    got = apply_penalties(logits, mask, counts_before(counts, drafts), f("repetition_penalty"),
                          f("presence_penalty"), f("frequency_penalty"))
    for i in range(num_reqs):
        real = [d for d in drafts[i].tolist() if d >= 0]
        for j in range(width):
            seen = outputs[i] + real[:j]  # position j sees the output and the drafts before it
            want = penalized(logits[i, j], prompts[i], seen, params[i])
            torch.testing.assert_close(got[i, j], want, rtol=1e-6, atol=1e-6)


def test_min_tokens_mask_matches_a_plain_loop():
    logits = torch.randn(2, 3, 6)
    banned = torch.tensor([[0, 1, 0, 0, 0, 1], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    got = mask_before_min(logits, banned, torch.tensor([1, 4]), torch.tensor([3, 4]))
    for i, (num_output, min_tokens) in enumerate([(1, 3), (4, 4)]):
        for j in range(3):
            early = num_output + j < min_tokens
            for t in range(6):
                want = float("-inf") if early and banned[i, t] else float(logits[i, j, t])
                assert float(got[i, j, t]) == want, (i, j, t)


PENALTIES = [SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.6),
             SamplingParams(temperature=0.0, max_tokens=14, presence_penalty=1.2),
             SamplingParams(temperature=0.0, max_tokens=14, frequency_penalty=0.9),
             SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=0.7, presence_penalty=-0.4,
                            frequency_penalty=1.1),
             SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.3,
                            logit_bias=((17, 3.0), (5, -5.0), (100, 2.5), (3, 1.0)))]
PROMPTS = [[3, 4, 5, 3, 4], [9, 9, 1], [7], [200, 17, 17, 17, 30, 2]]


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=5, agree=0.005)


@pytest.fixture(scope="module")
def references(pair):
    return {(i, k): penalized_greedy(pair[0], prompt, p) for i, prompt in enumerate(PROMPTS)
            for k, p in enumerate(PENALTIES)}


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("ahead", [False, True], ids=["", "step-ahead"])
def test_greedy_speculative_with_penalties_equals_plain_greedy(pair, references, static, ahead):
    """Each prompt with each penalty, batched with requests that have none (which keep their own output), and
    alone; the drafts were accepted, so verified positions saw the drafts before them."""
    llm = LLM(*pair, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=6, enforce_eager=not static)
    llm.executor.pipeline.step_ahead = llm.executor.pipeline.draft_ahead = ahead
    plain = SamplingParams(temperature=0.0, max_tokens=14)
    cases = [(i, k) for i in range(len(PROMPTS)) for k in range(len(PENALTIES))]
    prompts = [PROMPTS[i] for i, _ in cases] + PROMPTS
    outs = llm.generate(prompts, [PENALTIES[k] for _, k in cases] + [plain] * len(PROMPTS))
    for (i, k), out in zip(cases, outs):
        assert out.token_ids == references[i, k], (i, k)
    for prompt, out in zip(PROMPTS, outs[len(cases):]):
        assert out.token_ids == llm.generate([prompt], plain)[0].token_ids
    assert sum(o.stats["accepted"] for o in outs[:len(cases)]) > 20
    assert sum(references[i, 3] != outs[len(cases) + i].token_ids for i in range(len(PROMPTS))) >= 2  # they bite
    assert sum(references[i, 4] != outs[len(cases) + i].token_ids for i in range(len(PROMPTS))) >= 2
    alone = llm.generate([PROMPTS[0]], PENALTIES[3])[0]
    assert alone.token_ids == references[0, 3]


def _ends_at(target, prompt: list[int], index: int) -> tuple[list[int], int]:
    """A plain greedy output and a token id whose first occurrence in it is at `index` or later."""
    out = penalized_greedy(target, prompt, SamplingParams(temperature=0.0, max_tokens=16))
    k = next(k for k in range(index, 16) if out[k] not in out[:k])
    return out, k


@pytest.mark.parametrize("via", ["eos", "stop_token_ids"])
def test_min_tokens_keeps_eos_and_stop_ids_out_until_then(pair, via):
    target, draft = pair
    prompt = [1, 2, 3]
    out, k = _ends_at(target, prompt, 3)
    eos = (out[k],) if via == "eos" else ()
    llm = LLM(target, draft, device="cpu", block_size=8, eos_token_ids=eos)
    stop = {"stop_token_ids": (out[k],)} if via == "stop_token_ids" else {}
    for min_tokens in (0, k):  # k tokens precede it: allowed exactly at min_tokens = k
        got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=min_tokens, **stop))[0]
        assert got.token_ids == out[:k + 1] and got.finish_reason == "stop", min_tokens
    for min_tokens in (k + 1, 16):
        p = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=min_tokens, **stop)
        got = llm.generate([prompt], p)[0]
        assert got.token_ids == penalized_greedy(target, prompt, p, eos)
        assert out[k] not in got.token_ids[:min_tokens], (min_tokens, got.token_ids)
        assert len(got.token_ids) > min_tokens or got.finish_reason == "length"
    if via == "eos":  # with ignore_eos, EOS is neither masked nor an end
        p = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, ignore_eos=True)
        assert llm.generate([prompt], p)[0].token_ids == out
