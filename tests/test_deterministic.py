"""The deterministic mode in bfloat16: a request's tokens are the same alone, among 12 streams, behind a long prompt
prefilled in chunks and in batches that change every step, speculative or plain, greedy or seeded; and speculative
output equals plain output token for token."""

import pytest
import torch
from engine_pairs import build_pair, random_prompts

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams

KINDS = {"greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=12),
         "seeded": lambda i: SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12)}
LONG = 150  # the long prompt's tokens; steps take at most 16 (chunked prefill beside the streams)


@pytest.fixture(scope="module")
def pair():
    return build_pair(seed=4, dtype=torch.bfloat16, agree=0.005)


@pytest.fixture(scope="module")
def prompts():
    long = torch.randint(0, 255, (LONG,), generator=torch.Generator().manual_seed(5)).tolist()
    return random_prompts(9, 12) + [long]


def _llm(pair, spec: bool, deterministic: bool = True, **kw) -> LLM:
    target, draft = pair
    return LLM(target, draft if spec else None, device="cpu", block_size=4, num_kv_blocks=512, max_num_seqs=16,
               deterministic=deterministic, **kw)


@pytest.fixture(scope="module")
def solo(pair, prompts):
    """kind -> each prompt's tokens, run alone on a plain engine in the mode."""
    llm = _llm(pair, spec=False)
    return {kind: [llm.generate([p], make(i))[0].token_ids for i, p in enumerate(prompts)]
            for kind, make in KINDS.items()}


def _run_waves(llm: LLM, prompts, make, waves: list[tuple[int, int]]) -> list[list[int]]:
    """Add prompts[a:b] for each wave, then step twice before the next: the batch changes under running requests."""
    ids, out = {}, {}
    for a, b in waves:
        for i in range(a, b):
            ids[llm.add_request(prompts[i], make(i))] = i
        for _ in range(2):
            for o in llm.step():
                if o.finished:
                    out[ids[o.request_id]] = o
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                out[ids[o.request_id]] = o
    return [out[i] for i in sorted(out)]


def _check(outs, solo_tokens, spec: bool, kind: str) -> None:
    assert [o.token_ids for o in outs] == solo_tokens
    if spec:  # speculation really ran: drafts verified (and, greedy, accepted) beside other rows
        assert sum(o.stats["drafted"] for o in outs) > 0
        if kind == "greedy":
            assert sum(sum(o.stats["accepted_per_step"]) for o in outs) > 0


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_among_12_streams(pair, prompts, solo, kind, spec):
    outs = _llm(pair, spec).generate(prompts[:12], [KINDS[kind](i) for i in range(12)])
    _check(outs, solo[kind][:12], spec, kind)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_behind_a_long_prompt_in_chunks(pair, prompts, solo, kind, spec):
    llm = _llm(pair, spec, max_num_batched_tokens=16)
    order = [12] + list(range(12))  # the long prompt first: its chunks share steps with the streams
    outs = llm.generate([prompts[i] for i in order], [KINDS[kind](i) for i in order])
    _check(outs, [solo[kind][i] for i in order], spec, kind)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_in_changing_batches(pair, prompts, solo, kind, spec):
    llm = _llm(pair, spec, max_num_batched_tokens=24)
    outs = _run_waves(llm, prompts, KINDS[kind], [(0, 4), (12, 13), (4, 8), (8, 12)])
    _check(outs, solo[kind], spec, kind)


def test_default_mode_speculative_seeded_differs_from_plain(pair, prompts):
    """Without the mode, seeded speculative sampling is lossless in distribution but draws other tokens than plain
    sampling with the same seed (acceptance by min(1, p/q), residual resampling): the coupling is what the mode
    adds."""
    make = KINDS["seeded"]
    plain = _llm(pair, False, deterministic=False).generate(prompts[:12], [make(i) for i in range(12)])
    spec = _llm(pair, True, deterministic=False).generate(prompts[:12], [make(i) for i in range(12)])
    assert sum(a.token_ids != b.token_ids for a, b in zip(plain, spec)) >= 3
