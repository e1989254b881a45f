"""At T > 0, speculative sampling reproduces the target's own distribution (chi-square against exact probabilities)."""

import itertools
import math

import pytest
import torch
from engine_pairs import build_pair
from penalized import next_logits, penalized

from dspark_serve.engine.core.step_costs import StepCosts
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling import processed_probs
from dspark_serve.engine.sampling_params import SamplingParams

VOCAB, PROMPT, SAMPLES = 8, [1, 5, 2], 3000


def _chi2_sf(x: float, dof: int) -> float:
    """Upper tail of chi-square: regularized upper incomplete gamma Q(dof/2, x/2) by its series."""
    a, z = dof / 2, x / 2
    term = total = 1.0 / a
    for n in range(1, 2000):
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(-z + a * math.log(z) - math.lgamma(a)) * total)


def _exact_joint(target, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(t2, t3) under the target alone (t1 summed out), with the request's penalties (a plain loop over the
    output so far) and temperature / top-k / top-p / min-p."""
    def p_next(seq):
        out = seq[len(PROMPT):]
        logits = penalized(next_logits(target, seq), PROMPT, out, params)[None, None]
        t = lambda x, d: torch.tensor([x], dtype=d)  # noqa: E731
        return processed_probs(logits, t(params.temperature, torch.float32), t(params.top_k, torch.int64),
                               t(params.top_p, torch.float32), t(params.min_p, torch.float32))[0, 0].double()
    p1 = p_next(PROMPT)
    joint = {k: 0.0 for k in itertools.product(range(VOCAB), repeat=2)}
    for a in range(VOCAB):
        if p1[a] > 0:
            p2 = p_next(PROMPT + [a])
            for b in range(VOCAB):
                if p2[b] > 0:
                    p3 = p_next(PROMPT + [a, b])
                    for c in range(VOCAB):
                        joint[(b, c)] += float(p1[a] * p2[b] * p3[c])
    return joint


CASES = {
    "q-differs-from-p": (dict(), {}, SamplingParams(temperature=1.0, max_tokens=3)),
    "draft-topk3": (dict(), {"dspark_draft_topk": 3}, SamplingParams(temperature=0.8, max_tokens=3)),
    "target-topk-topp-minp": (dict(), {}, SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05, max_tokens=3)),
    "confidence-trimming": (dict(), {"dspark_confidence_threshold": 0.4}, SamplingParams(temperature=1.0, max_tokens=3)),
    "survival-trimming": (dict(), {"dspark_survival_threshold": 0.4}, SamplingParams(temperature=1.0, max_tokens=3)),
    "greedy-drafts": (dict(), {"draft_sample_method": "greedy"}, SamplingParams(temperature=1.0, max_tokens=3)),
    "token-cap": (dict(), {"dspark_max_verify_tokens": 300}, SamplingParams(temperature=1.0, max_tokens=3)),
    "adaptive-binding": (dict(), {"enable_adaptive_verification": True}, SamplingParams(temperature=1.0, max_tokens=3)),
}
# every capped draft is verified (the policy off) but in the adaptive case, whose step costs make the budget cut
# some slots of each 512-request step: the slots verified then depend on the other requests' survivals
ENGINE = {"adaptive-binding": {"step_costs": StepCosts.linear(2.0, 0.004, 0.1, 0.0)}}


AGREE = dict(agree=0.05)  # token 2 is an accepted draft in about half the samples: token 3 sees it as a draft
PENALTY_CASES = {
    "repetition": (AGREE, {}, SamplingParams(temperature=1.0, max_tokens=3, repetition_penalty=2.0)),
    "presence": (AGREE, {}, SamplingParams(temperature=1.0, max_tokens=3, presence_penalty=2.0)),
    "frequency": (AGREE, {}, SamplingParams(temperature=1.0, max_tokens=3, frequency_penalty=1.5)),
    "penalties-combined": (AGREE, {}, SamplingParams(temperature=0.9, top_k=6, max_tokens=3, repetition_penalty=1.5,
                                                     presence_penalty=1.5, frequency_penalty=0.5)),
    "logit-bias": (AGREE, {}, SamplingParams(temperature=1.0, max_tokens=3, logit_bias=((2, 1.2), (6, -1.5), (0, 0.7)))),
}


@pytest.mark.parametrize("name", list(CASES) + list(PENALTY_CASES))
def test_speculative_sampling_matches_target_distribution(name):
    """The penalty cases: the penalized target's distribution, token 3 penalized for token 2 as a draft."""
    kw, spec, params = {**CASES, **PENALTY_CASES}[name]
    target, draft = build_pair(seed=11, vocab=VOCAB, block_size=3, markov_rank=4, **kw)
    llm = LLM(target, draft, {"enable_adaptive_verification": False, **spec}, device="cpu", block_size=8,
              num_kv_blocks=4096, max_num_seqs=512, **ENGINE.get(name, {}))
    outs = llm.generate([PROMPT] * SAMPLES, [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(SAMPLES)])
    drafted = sum(o.stats["drafted"] for o in outs)  # tokens 2 and 3 went through verification
    if "trimming" in name or "cap" in name or "binding" in name:
        assert 100 < drafted < SAMPLES * 0.9, drafted  # trimmed for some requests, not for all
    else:
        assert drafted == SAMPLES, drafted
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        key = tuple(o.token_ids[1:])
        counts[key] = counts.get(key, 0) + 1
    exact = _exact_joint(target, params)
    assert all(exact[k] > 0 for k in counts), "a token outside the target's support was emitted"
    cells = [k for k in exact if exact[k] * SAMPLES >= 5]
    rest = 1.0 - sum(exact[k] for k in cells)
    stat = sum((counts.get(k, 0) - SAMPLES * exact[k]) ** 2 / (SAMPLES * exact[k]) for k in cells)
    observed_rest = SAMPLES - sum(counts.get(k, 0) for k in cells)
    if rest * SAMPLES >= 1:
        stat += (observed_rest - SAMPLES * rest) ** 2 / (SAMPLES * rest)
    p_value = _chi2_sf(stat, len(cells) - (0 if rest * SAMPLES >= 1 else 1))
    assert p_value > 1e-3, (name, stat, len(cells), p_value)


@pytest.mark.parametrize("spec", [{}, {"dspark_confidence_threshold": 0.4}, {"dspark_survival_threshold": 0.3}],
                         ids=["default", "confidence-threshold", "survival-threshold"])
def test_same_seed_same_output_alone_or_batched(spec):
    """A seeded request's tokens do not depend on the batch: each alone equals itself among seeded, unseeded and
    greedy requests of other lengths, which join and leave the batch at other steps."""
    target, draft = build_pair(seed=2, vocab=64, block_size=4)
    prompts = [[3, 4, 5], [9, 9], [1], [7, 2, 8, 8, 1], [5], [6, 6, 6, 6]]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=1234),
              SamplingParams(temperature=0.7, max_tokens=5),
              SamplingParams(temperature=0.0, max_tokens=9),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=15, seed=7),
              SamplingParams(temperature=1.2, top_p=0.9, max_tokens=10, seed=99),
              SamplingParams(temperature=1.0, max_tokens=3, seed=5)]
    # the policy off: with it on, how many drafts a step verifies depends on the batch
    llm = LLM(target, draft, {"enable_adaptive_verification": False, **spec}, device="cpu", max_num_seqs=4)
    mixed = llm.generate(prompts, params)
    for i in (0, 3, 4, 5):
        alone = llm.generate([prompts[i]], params[i])[0]
        assert alone.token_ids == mixed[i].token_ids, (i, alone.token_ids, mixed[i].token_ids)
        assert len(alone.token_ids) == params[i].max_tokens


def test_chi2_sf_matches_known_values():
    assert abs(_chi2_sf(3.841, 1) - 0.05) < 1e-3 and abs(_chi2_sf(18.307, 10) - 0.05) < 1e-3
