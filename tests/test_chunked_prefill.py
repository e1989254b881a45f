"""Chunked prefill within the step's token budget: outputs are the same with and without chunking (fp32, greedy and
seeded sampling, speculative and plain), and a long prompt's chunks never hold a running stream back: that stream
gets new tokens from every step while the long prompt is prefilled."""

from __future__ import annotations

import pytest
import torch
from engine_pairs import build_pair

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in (57, 4, 33, 90, 12, 41)]


@pytest.mark.parametrize("with_draft", [True, False])
@pytest.mark.parametrize("static", [False, True])
def test_chunked_equals_unchunked(with_draft, static):
    target, draft = build_pair(seed=4, agree=0.01, block_size=5, dtype=torch.float32)
    draft = draft if with_draft else None
    prompts = _prompts(1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs, chunked = [], None
    for tokens in (4096, 24):  # 3 decode rows of 1 + 4 drafts fit in 24: only the prompts are cut
        # the policy off: every capped draft is verified, whatever runs beside a request
        llm = LLM(target, draft, {"enable_adaptive_verification": False} if draft is not None else {}, device="cpu",
                  block_size=8, num_kv_blocks=256, max_num_seqs=3, max_num_batched_tokens=tokens,
                  enforce_eager=not static)
        seen = []
        schedule = llm.scheduler.schedule

        def watching():
            plan = schedule()
            seen.append([(c.start, len(c.tokens)) for c in plan.prefill])
            return plan
        llm.scheduler.schedule = watching
        outs.append(llm.generate(prompts, params))
        chunked = seen
        assert llm.kv.all_free()
    assert any(start > 0 for step in chunked for start, _ in step)  # the small budget did cut prompts
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason


def test_a_long_prompt_never_holds_a_running_stream_back():
    """A 600-token prompt arrives while a stream decodes, with a 40-token budget: it is prefilled over many steps,
    and every one of them brings the running stream new tokens (the order of the step outputs, not timing)."""
    target, draft = build_pair(seed=4, agree=0.01, block_size=5, dtype=torch.float32)
    llm = LLM(target, draft, {}, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=40)
    running = llm.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    llm.step()
    llm.step()
    long = llm.add_request([i % 250 for i in range(1, 601)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    steps = []
    while True:
        outs = {o.request_id: o for o in llm.step()}
        steps.append(outs)
        if long in outs:
            break
    assert len(steps) >= 600 // 40  # the prompt took many budgeted steps
    assert all(running in s and s[running].new_token_ids for s in steps)  # the stream moved in every one
    llm.abort(running)
    llm.abort(long)
    while llm.has_unfinished():
        llm.step()
